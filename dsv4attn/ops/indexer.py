"""Public lightning-indexer op: validate -> allocate -> dispatch (Triton kernel or reference).

:func:`indexer_topk` scores each query token against its own request's indexer keys, read from
the paged indexer-K cache, and returns the deterministic top-k (equal scores -> lower entry
index; -1 padding). Semantics: :mod:`dsv4attn.reference.indexer`; kernel design:
:mod:`dsv4attn.kernels.indexer`.
"""

from __future__ import annotations

import torch
import triton

from dsv4attn._checks import check_tensor, same_device
from dsv4attn.device import resolve_impl, sm_count
from dsv4attn.kernels.indexer import _indexer_topk_kernel
from dsv4attn.kv_cache.specs import INDEXER_SCALE_BYTES
from dsv4attn.reference.indexer import indexer_topk_ref

_Q_DTYPES = (torch.bfloat16, torch.float32)
#: Keys gathered per dot in the kernel (a [BLOCK_N, D] x [D, H] product per step, 4 warps): 128 on
#: the bf16 tensor cores (H200, V4 shape: fastest of 64/128 keys x 4/8/16 warps, docs/benchmarks.md
#: Tables 29 and 41; ptxas, offline, sm_90a, top-512: 255 registers per thread with Triton 3.6,
#: 249 with 3.9, no spills); 32 for fp32 q (FMA dots, not timed: they spill ~2 KB per thread at 4
#: warps; offline, 16 warps would not spill).
_BLOCK_N = {True: 128, False: 32}
#: Largest top-k: the kernel keeps the best list in registers (engines use 512, 1024, 2048).
MAX_TOPK = 2048
#: Most programs one token row is split over (small-batch decode of long contexts).
_MAX_SPLITS = 16
#: A chunk with at most this many keys above the running k-th best sorts only those (compacted
#: in registers) instead of all of its keys: 4-12% faster at 64K entries on the H200, where most
#: chunks of a long row bring few new keys (docs/benchmarks.md, Table 43).
_FEW = 128


def _p2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def check_indexer_cache(name: str, cache: torch.Tensor, head_dim: int) -> bool:
    """Raise unless ``cache`` is an indexer-K cache for keys of ``head_dim``; return True for fp8.

    fp8: uint8 ``(num_blocks, block_size, head_dim + 4)`` view, contiguous entry bytes, block
    stride >= the page bytes and 4-byte aligned (scales are read as fp32). "auto": bf16/fp32
    ``(num_blocks, block_size, head_dim)`` with a contiguous last dim.
    """
    check_tensor(name, cache, dtype=(torch.uint8, torch.bfloat16, torch.float32), ndim=3)
    nb, bs = cache.shape[0], cache.shape[1]
    if nb < 1 or bs < 1:
        raise ValueError(f"{name} must hold at least one entry, got shape {tuple(cache.shape)}")
    if cache.dtype != torch.uint8:
        if cache.shape[2] != head_dim or cache.stride(2) != 1:
            raise ValueError(f"{name} must be (num_blocks, block_size, {head_dim}) with a contiguous last dim, "
                             f"got shape {tuple(cache.shape)} strides {cache.stride()}")
        return False
    entry = head_dim + INDEXER_SCALE_BYTES
    if cache.shape[2] != entry or cache.stride(2) != 1 or (bs > 1 and cache.stride(1) != entry):
        raise ValueError(f"{name} (fp8) must be (num_blocks, block_size, {entry}) uint8 with contiguous entries, "
                         f"got shape {tuple(cache.shape)} strides {cache.stride()}")
    if nb > 1 and cache.stride(0) < bs * entry:
        raise ValueError(f"{name} block stride {cache.stride(0)} < page bytes {bs * entry}")
    if cache.data_ptr() % 4 or (nb > 1 and cache.stride(0) % 4):
        raise ValueError(f"{name} pages must be 4-byte aligned (data_ptr and stride(0)): scales are fp32")
    return True


def check_paged_rows(block_table: torch.Tensor, token_to_req: torch.Tensor, lengths: torch.Tensor, num_tokens: int,
                     num_blocks: int, block_size: int, device: torch.device, validate: bool) -> None:
    """Check a range description (block_table int32 ``[R, max_blocks]`` with contiguous rows,
    token_to_req / lengths int32 ``[T]``); with ``validate`` also the values (one host sync):
    requests in ``[0, R)``, lengths in ``[0, max_blocks * block_size]``, block ids in
    ``[-1, num_blocks)``."""
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(num_tokens,), device=device)
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(num_tokens,), device=device)
    R, cols = block_table.shape
    if cols > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if num_tokens and R == 0:
        raise ValueError("block_table has no rows but there are tokens")
    if not validate or num_tokens == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(token_to_req))
    if lo < 0 or hi >= R:
        raise ValueError(f"token_to_req values must be in [0, {R}), got [{lo}, {hi}]")
    lo, hi = (int(v) for v in torch.aminmax(lengths))
    if lo < 0 or hi > cols * block_size:
        raise ValueError(f"lengths must be in [0, {cols * block_size}] (block_table columns x block_size), "
                         f"got [{lo}, {hi}]")
    if block_table.numel():
        lo, hi = (int(v) for v in torch.aminmax(block_table))
        if lo < -1 or hi >= num_blocks:
            raise ValueError(f"block_table ids must be in [-1, {num_blocks}), got [{lo}, {hi}]")


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    validate_indices: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer top-k of every query token over its request's paged indexer keys.

    q: ``[T, H, D]`` bf16/fp32 indexer queries (last dim contiguous). weights: ``[T, H]`` fp32
    per-head weights carrying every scale (``s = sum_h w[h] * ReLU(q[h] . K)``). k_cache: fp8
    pages uint8 ``(num_blocks, block_size, D + 4)`` (D e4m3fn bytes per entry, then one fp32
    scale per entry at ``block_size*D + off*4``; padded block stride) or "auto" bf16/fp32 rows
    ``(num_blocks, block_size, D)``. block_table: int32 ``[R, max_blocks]`` of the indexer-K
    group. token_to_req, lengths: int32 ``[T]``; token t's candidates are entries
    ``0 .. lengths[t]-1`` of request ``token_to_req[t]`` (a -1 block is a hole: skipped).
    topk: 1 .. ``MAX_TOPK`` (2048).

    Returns ``(indices int32 [T, topk], scores fp32 [T, topk])``: request-local entry indices,
    best first, equal scores -> lower index, ``-1`` (score ``-inf``) past the token's
    candidates. ``validate_indices=False`` skips the value checks (a host sync); bad values are
    then masked in the kernel (never dereferenced), not reported. bf16 q is multiplied in bf16
    (keys are exact in bf16), fp32 q in fp32.
    """
    check_tensor("q", q, dtype=_Q_DTYPES, ndim=3)
    T, H, D = q.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H))
    device = same_device(q=q, weights=weights, k_cache=k_cache if isinstance(k_cache, torch.Tensor) else None)
    is_fp8 = check_indexer_cache("k_cache", k_cache, D)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk must be an int in [1, {MAX_TOPK}], got {topk!r}")
    if H < 1 or D < 1:
        raise ValueError(f"q must have at least one head and one dim, got shape {tuple(q.shape)}")
    if q.stride(2) != 1 or weights.stride(1) != 1:
        raise ValueError(f"q and weights must be contiguous in their last dim, got strides {q.stride()}, "
                         f"{weights.stride()}")
    check_paged_rows(block_table, token_to_req, lengths, T, k_cache.shape[0], k_cache.shape[1], device,
                     validate_indices)
    path = resolve_impl(impl, device)
    if path == "reference":
        return indexer_topk_ref(q, weights, k_cache, block_table, token_to_req, lengths, topk)
    return _indexer_topk_triton(q, weights, k_cache, block_table, token_to_req, lengths, topk, is_fp8,
                                _num_splits(T, device))


def _num_splits(num_tokens: int, device: torch.device) -> int:
    """Programs per token row: as many as fit in one wave of two programs per SM (CUDA; at 4
    warps and ~255 registers two share an SM), capped at ``_MAX_SPLITS``; 1 on the interpreter.
    Rounded down: one program more than the wave holds starts a second wave that doubles the
    time (B64 / 64K took 5 splits, 320 programs for 264 places). Chosen from the token count only
    (no host sync on lengths): splits beyond a row's chunks return at once and merge as empty
    lists."""
    if device.type != "cuda" or num_tokens == 0:
        return 1
    return max(1, min(_MAX_SPLITS, 2 * sm_count(device) // num_tokens))


def _indexer_topk_triton(q, weights, k_cache, block_table, token_to_req, lengths, topk, is_fp8, num_splits, *,
                         words=None, num_warps=4, block_n=None, few=None, asm=None):
    """Launch the Triton path on validated input with ``num_splits`` programs per token.
    ``words`` (fp8 keys loaded as 32-bit words: default where the head dim allows, 13-15% faster
    on the H200), ``num_warps``, ``block_n`` (keys per dot) and ``few`` (sort only a chunk's keys
    above the running threshold when at most this many are: a power of two, 0 = off; default
    ``_FEW``, at most half the list) and ``asm`` (word-loaded fp8 keys decoded to bf16 pairs by
    inline PTX; default on CUDA devices, all of compute capability 8.0 and up where the Triton
    path runs) are there for tests and variant sweeps."""
    T, H, D = q.shape
    device = q.device
    idx = torch.empty((T, topk), dtype=torch.int32, device=device)
    val = torch.empty((T, topk), dtype=torch.float32, device=device)
    if T == 0:
        return idx, val
    k_p2 = _p2(topk)
    log_k = k_p2.bit_length() - 1  # K_P2 = 2^log_k: the bitonic merge's stage count
    scratch = torch.empty((T, num_splits, k_p2), dtype=torch.int64, device=device)
    counters = _split_counters(T, device) if num_splits > 1 else scratch  # unread without splits
    interp = device.type == "cpu"  # the interpreter's bf16 dot is unreliable: fp32 there
    dot_bf16 = q.dtype == torch.bfloat16 and k_cache.dtype != torch.float32 and not interp
    h_p2, d_p2 = _p2(H), _p2(D)
    # fp8 keys as words where they can be: a dot over D / 4 dims per byte of a word needs D_P2 / 4 >= 16
    can_words = is_fp8 and D % 4 == 0 and d_p2 >= 64
    words = can_words if words is None else (words and can_words)
    # the PTX needs sm_80, which every GPU the Triton path runs on has (device.MIN_TRITON_CAPABILITY)
    can_asm = bool(words) and dot_bf16 and device.type == "cuda"
    asm = can_asm if asm is None else (asm and can_asm)
    _indexer_topk_kernel[(T, num_splits)](
        q, weights, k_cache, block_table, token_to_req, lengths, scratch, counters, idx, val,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        idx.stride(0), val.stride(0),
        H, block_table.shape[0], k_cache.shape[1], block_table.shape[1], k_cache.shape[0], topk, num_splits,
        HEAD_DIM=D, H_P2=h_p2, D_P2=d_p2, BLOCK_N=min(block_n or _BLOCK_N[dot_bf16], k_p2), K_P2=k_p2,
        IS_FP8=is_fp8, DOT_BF16=dot_bf16, SPLIT=num_splits > 1, LOG_K=log_k,
        WORDS=bool(words), FEW=min(_FEW if few is None else few, k_p2 // 2), ASM=bool(asm),
        num_warps=num_warps,
    )
    return idx, val


#: Per device, the split kernel's arrival counters (int32, all zero between launches: the last
#: split of each token resets its own). Kept for the process: CUDA graphs captured with a buffer
#: read it on every replay, so a buffer is never freed, only joined by a larger one.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(num_tokens: int, device: torch.device) -> torch.Tensor:
    """A zero int32 buffer of at least ``num_tokens`` entries on ``device``, allocated once (at
    least 64K entries). Launches that share it must run one after another, as on one stream."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < num_tokens:
        bufs.append(torch.zeros(max(num_tokens, 1 << 16), dtype=torch.int32, device=device))
    return bufs[-1]
