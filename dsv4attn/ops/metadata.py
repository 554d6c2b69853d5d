"""Public per-step metadata ops: validate -> allocate -> dispatch (Triton kernel or reference).

Two entry points keep the engine-compatible signatures (``get_compressed_slot_mapping``,
``build_c128a_topk_metadata``); the others are this project's SWA, top-k conversion and range
ops. All of them write only into the buffers they are given (the builders own persistent,
address-stable buffers for CUDA-graph replay) and return slices of them.

Block sizes: every ``block_size`` argument counts ENTRIES physically stored per block of the
cache the slots index (SWA 64, C4A compressed 64 = 256 // 4, C128A compressed 2 = 256 // 128).
This is vLLM's "storage block size", which it passes to the same functions.

Out-of-table reads: an entry whose block column is ``>= block_table.shape[1]`` or whose block id
is negative becomes -1 (:mod:`dsv4attn.kv_cache.slots`) instead of an out-of-bounds read.

Validation (the contract of docs/design.md): every op checks types, dtypes, shapes, devices and
sizes on every call (host-only, no sync). With ``validate=True`` (the default) it also checks the
values that address memory, with one host sync: token-to-request indices name rows of the block
table, positions keep ``p + 1`` inside int32, int32 slot outputs cannot overflow, and
``query_start_loc`` / ``seq_lens`` describe a batch. ``StepMetadataBuilder`` proves all of that
once per step from its ``BatchMetadata`` and calls the ops with ``validate=False`` (also the
setting for CUDA-graph capture). Strided 1-D inputs are made contiguous (a copy only when they
are not); outputs must have a unit last-dim stride.
"""

from __future__ import annotations

import torch
import triton

from dsv4attn._checks import INT32_MAX, check_int, check_tensor, check_values, same_device
from dsv4attn.device import resolve_impl
from dsv4attn.kernels import metadata as K
from dsv4attn.reference import metadata as R
from dsv4attn.kv_cache.slots import C128A_TOPK_ALIGNMENT, DEFAULT_MAX_COMPRESSED_TOKENS

#: Positions must leave ``p + 1`` inside int32 (lengths and entry counts are int32).
MAX_POSITION = INT32_MAX - 1
#: Widest sliding window one program covers (the kernel holds the whole row).
MAX_WINDOW = 1 << 16

_INT = (torch.int32, torch.int64)


def _check_int(name: str, v: object, lo: int = 0, hi: int = INT32_MAX) -> int:
    return check_int(name, v, lo, hi)


def _check_block_table(block_table: object, num_reqs: int | None = None) -> torch.Tensor:
    bt = check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    if num_reqs is not None and bt.shape[0] < num_reqs:
        raise ValueError(f"block_table must have at least {num_reqs} rows, got shape {tuple(bt.shape)}")
    return bt


def _check_slot_range(block_table: torch.Tensor, block_size: int) -> None:
    """int32 slots: the largest block id's last slot must fit in int32 (one host sync)."""
    if block_table.numel():
        top = int(block_table.max())
        if (top + 1) * block_size - 1 > INT32_MAX:
            raise ValueError(f"block_table holds block id {top}: with block_size {block_size} its slots pass the "
                             f"int32 limit of the int32 outputs")


def _check_requests(name: str, t2r: torch.Tensor, num_rows: int) -> None:
    """Token-to-request indices must name rows of the block table: -1 or any other value outside
    ``[0, rows)`` would read another request's row or outside the table."""
    check_values(name, t2r, 0, num_rows - 1)


def _check_out(name: str, t: object, rows: int, cols: int | None, dtype: torch.dtype) -> torch.Tensor:
    t = check_tensor(name, t, dtype=dtype, ndim=1 if cols is None else 2)
    if t.shape[0] < rows or (cols is not None and t.shape[1] < cols):
        want = (rows,) if cols is None else (rows, cols)
        raise ValueError(f"{name} is too small: needs at least {want}, got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last-dim stride, got strides {t.stride()}")
    return t


def _check_batch_tensors(qsl: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """query_start_loc starts at 0 and never decreases; 0 <= query_len <= seq_len < 2^31 (one sync)."""
    q = qsl.detach().cpu().long()
    s = seq_lens.detach().cpu().long()
    if q.numel() and int(q[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(q[0])}")
    ql = q[1:] - q[:-1]
    if ql.numel() and int(ql.min()) < 0:
        i = int((ql < 0).nonzero()[0, 0])
        raise ValueError(f"query_start_loc must be non-decreasing: [{i}]={int(q[i])} > [{i + 1}]={int(q[i + 1])}")
    if s.numel() and bool((s < ql).any()):
        i = int((s < ql).nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}]={int(s[i])} is smaller than its query length {int(ql[i])}")
    check_values("seq_lens", seq_lens, 0, MAX_POSITION)


def search_iters(num_reqs: int) -> int:
    """Binary-search steps over ``num_reqs + 1`` request starts, in buckets of 4 (4, 8, 12, ...):
    extra steps are no-ops, and a bucket (a compile-time constant) changes only at 16, 256,
    4096 requests, so serving does not compile a new kernel for every power of two."""
    return 4 * -(-max(1, num_reqs.bit_length()) // 4)


def get_compressed_slot_mapping(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    out: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Compressed-cache slot per raw token: int64 ``[num_tokens]`` (a prefix of ``out``).

    query_start_loc int32 ``[R+1]``, seq_lens int32 ``[R]`` (total length incl. this step),
    block_table int32 ``[>=R, max_blocks]`` of the compressed cache, ``block_size`` = compressed
    ENTRIES per block. Token t of request q sits at ``p = seq_lens[q] - query_len[q] + (t -
    query_start_loc[q])``; only a token with ``(p + 1) % compress_ratio == 0`` completes entry
    ``k = (p + 1) // compress_ratio - 1`` and gets its slot; every other token, tokens at or past
    ``query_start_loc[R]``, and the whole tail of ``out`` beyond ``num_tokens`` get -1.

    Context parallelism, exactly the engine's formula (vLLM ``compressor_utils``) for every
    interleave size I: with ``c = p // compress_ratio`` and ``vbs = block_size * cp_world_size``,
    ``voff = c % vbs``; the entry is this rank's iff ``(voff // I) % cp_world_size == cp_rank``,
    stored at ``block_table[q, c // vbs] * block_size + (voff // (cp_world_size * I)) * I +
    voff % I`` (the table is the rank's own). Tokens whose entry lives on another rank get -1.
    When I does not divide ``block_size`` the engine's in-block offset can reach past
    ``block_size``; the result is kept equal to the engine's (the cache writers then refuse or
    skip slots outside the cache).
    """
    _check_int("num_tokens", num_tokens)
    _check_int("block_size", block_size, 1)
    _check_int("compress_ratio", compress_ratio, 1)
    _check_int("cp_world_size", cp_world_size, 1)
    _check_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size, 1)
    if not 0 <= _check_int("cp_rank", cp_rank) < cp_world_size:
        raise ValueError(f"cp_rank must be in [0, cp_world_size={cp_world_size}), got {cp_rank}")
    seq_lens = check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    num_reqs = seq_lens.shape[0]
    qsl = check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, shape=(num_reqs + 1,))
    bt = _check_block_table(block_table, num_reqs)
    qsl, seq_lens = qsl.contiguous(), seq_lens.contiguous()
    dev = same_device(query_start_loc=qsl, seq_lens=seq_lens, block_table=bt, out=out)
    if validate:
        _check_batch_tensors(qsl, seq_lens)
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    out = _check_out("out", out, num_tokens, None, torch.int64)
    if resolve_impl(impl, dev) == "reference" or num_reqs == 0 or out.shape[0] == 0:
        return R.get_compressed_slot_mapping_ref(
            num_tokens, qsl, seq_lens, bt, block_size, compress_ratio, out,
            cp_world_size, cp_rank, cp_kv_cache_interleave_size,
        )
    block = 1024
    K._compressed_slot_mapping_kernel[(triton.cdiv(out.shape[0], block),)](
        out, qsl, seq_lens, bt, bt.stride(0), bt.stride(1), num_tokens, out.shape[0], num_reqs,
        bt.shape[1], block_size, compress_ratio, cp_world_size, cp_rank, cp_kv_cache_interleave_size,
        SEARCH_ITERS=search_iters(num_reqs), BLOCK=block,
    )
    return out[:num_tokens]


def build_c128a_topk_metadata(
    positions: torch.Tensor,
    compress_ratio: int,
    num_decode_tokens: int,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
    global_decode_buffer: torch.Tensor,
    decode_lens_buffer: torch.Tensor,
    prefill_buffer: torch.Tensor,
    max_compressed_tokens: int = DEFAULT_MAX_COMPRESSED_TOKENS,
    full_width: bool = True,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """C128A dense top-k rows: ``(global_decode [nd, W], decode_lens [nd], prefill_local [T-nd, W])``.

    positions int64/int32 ``[T]`` (decodes first: tokens ``< num_decode_tokens`` are decodes),
    token_to_req_indices int32 ``[T]``, block_table int32 ``[R, max_blocks]`` of the compressed
    cache, ``block_size`` = compressed ENTRIES per block (2 for C128A with 256-token blocks),
    slot_mapping int64/int32 ``[T]`` (the raw per-token slot; -1 = padded token); buffers int32
    ``[rows, W]``, ``[rows]``, ``[rows, W]``. Returned tensors are slices of the buffers.

    With ``n = min((p + 1) // compress_ratio, max_compressed_tokens)`` (clamped, as the engine
    does; default 8192 as in the engine): decode row t holds the global slots of entries
    ``0..n-1`` then -1, ``decode_lens[t] = n`` (0 when ``slot_mapping[t] < 0``); prefill row holds
    local indices ``0..n-1`` then -1. ``full_width=True`` (engine form) writes columns
    ``[0, max_compressed_tokens)`` of each row; ``full_width=False`` (real-context form) writes
    only ``[0, round_up(n, 128))`` (capped at ``max_compressed_tokens``) and leaves the rest of the
    row untouched (never read, since every consumer bounds reads by the length). No kernel writes
    past ``max_compressed_tokens``, which must be <= each buffer's row width W (the engine would
    spill into the next row; here it is a ``ValueError``).
    """
    _check_int("compress_ratio", compress_ratio, 1)
    _check_int("block_size", block_size, 1)
    _check_int("max_compressed_tokens", max_compressed_tokens)
    pos = check_tensor("positions", positions, dtype=_INT, ndim=1)
    num_tokens = pos.shape[0]
    nd = _check_int("num_decode_tokens", num_decode_tokens)
    if nd > num_tokens:
        raise ValueError(f"num_decode_tokens={nd} exceeds the number of tokens {num_tokens}")
    t2r = check_tensor("token_to_req_indices", token_to_req_indices, dtype=torch.int32, ndim=1)
    if t2r.shape[0] < num_tokens:
        raise ValueError(f"token_to_req_indices needs >= {num_tokens} entries, got {tuple(t2r.shape)}")
    sm = check_tensor("slot_mapping", slot_mapping, dtype=_INT, ndim=1)
    if sm.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping needs >= {num_tokens} entries, got {tuple(sm.shape)}")
    bt = _check_block_table(block_table)
    pos, t2r, sm = pos.contiguous(), t2r.contiguous(), sm.contiguous()
    gdec = _check_out("global_decode_buffer", global_decode_buffer, nd, max_compressed_tokens, torch.int32)
    dlens = _check_out("decode_lens_buffer", decode_lens_buffer, nd, None, torch.int32)
    pref = _check_out("prefill_buffer", prefill_buffer, num_tokens - nd, max_compressed_tokens, torch.int32)
    dev = same_device(positions=pos, token_to_req_indices=t2r, block_table=bt, slot_mapping=sm,
                      global_decode_buffer=gdec, decode_lens_buffer=dlens, prefill_buffer=pref)
    if validate:
        check_values("positions", pos, None, MAX_POSITION)
        _check_requests("token_to_req_indices", t2r[:nd], bt.shape[0])
        _check_slot_range(bt, block_size)
    if resolve_impl(impl, dev) == "reference" or num_tokens == 0:
        return R.build_c128a_topk_metadata_ref(
            pos, compress_ratio, nd, t2r, bt, block_size, sm, gdec, dlens, pref,
            max_compressed_tokens, full_width,
        )
    K._c128a_topk_kernel[(num_tokens,)](
        pos, t2r, bt, bt.stride(0), bt.stride(1), bt.shape[1], block_size, sm,
        gdec, gdec.stride(0), dlens, pref, pref.stride(0), nd, compress_ratio, max_compressed_tokens,
        FULL_WIDTH=full_width, ALIGN=C128A_TOPK_ALIGNMENT, BLOCK=1024,
    )
    return gdec[:nd], dlens[:nd], pref[: num_tokens - nd]


def compute_swa_indices_and_lens(
    positions: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    slot_mapping: torch.Tensor,
    window_size: int,
    indices_out: torch.Tensor | None = None,
    lens_out: torch.Tensor | None = None,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window indices: ``(indices int32 [T, >=W], lens int32 [T])``, slices of the outputs.

    For token t at position p (request ``token_to_req_indices[t]``): ``start = max(0, p-W+1)``,
    ``lens[t] = p + 1 - start`` (= min(p+1, W)), or 0 when ``slot_mapping[t] < 0`` (padded);
    columns ``j < lens[t]`` hold the global SWA slot of position ``start + j`` through
    ``block_table`` (``block_size`` = 64 entries for the SWA cache), columns ``lens[t]..W-1`` are
    -1. Exactly columns ``[0, W)`` of each of the first T rows are written.
    """
    _check_int("block_size", block_size, 1)
    _check_int("window_size", window_size, 1, MAX_WINDOW)
    pos = check_tensor("positions", positions, dtype=_INT, ndim=1)
    num_tokens = pos.shape[0]
    t2r = check_tensor("token_to_req_indices", token_to_req_indices, dtype=torch.int32, shape=(num_tokens,))
    sm = check_tensor("slot_mapping", slot_mapping, dtype=_INT, shape=(num_tokens,))
    bt = _check_block_table(block_table)
    pos, t2r, sm = pos.contiguous(), t2r.contiguous(), sm.contiguous()
    dev = same_device(positions=pos, token_to_req_indices=t2r, block_table=bt, slot_mapping=sm,
                      indices_out=indices_out, lens_out=lens_out)
    if indices_out is None:
        indices_out = torch.empty(num_tokens, window_size, dtype=torch.int32, device=dev)
    if lens_out is None:
        lens_out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    idx = _check_out("indices_out", indices_out, num_tokens, window_size, torch.int32)
    lens = _check_out("lens_out", lens_out, num_tokens, None, torch.int32)
    if validate:
        check_values("positions", pos, None, MAX_POSITION)
        _check_requests("token_to_req_indices", t2r, bt.shape[0])
        _check_slot_range(bt, block_size)
    if resolve_impl(impl, dev) == "reference" or num_tokens == 0:
        return R.compute_swa_indices_and_lens_ref(pos, t2r, bt, block_size, sm, window_size, idx, lens)
    K._swa_indices_kernel[(num_tokens,)](
        pos, t2r, bt, bt.stride(0), bt.stride(1), bt.shape[1], block_size, sm,
        idx, idx.stride(0), lens, window_size, BLOCK_W=triton.next_power_of_2(window_size),
    )
    return idx[:num_tokens, :window_size], lens[:num_tokens]


def compute_global_topk_indices_and_lens(
    topk_local: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    out: torch.Tensor | None = None,
    lens_out: torch.Tensor | None = None,
    entry_limit: torch.Tensor | None = None,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request-local top-k -> global compressed slots: ``(global int32 [T, K], lens int32 [T])``.

    topk_local int32 ``[T, K]`` (entry indices of the token's request, -1 = none), token_to_req
    int32 ``[T]``, block_table int32 ``[R, max_blocks]``, ``block_size`` = compressed entries per
    block (64 for C4A), is_valid_token bool ``[T]``. ``global[t, j]`` = slot of ``topk_local[t, j]``
    when it is >= 0, else -1; ``lens[t]`` = number of entries >= 0 in the row (holes may sit
    anywhere in the row), 0 for invalid tokens. Columns ``[0, K)`` of the first T rows are written.
    ``entry_limit`` int32 ``[>= T]`` (optional): entries ``>= entry_limit[t]`` (beyond the token's
    own context, e.g. ``(p + 1) // 4``) are holes too and not counted, so an index past the
    request's real entries never reaches another request's blocks.
    """
    _check_int("block_size", block_size, 1)
    loc = check_tensor("topk_local", topk_local, dtype=torch.int32, ndim=2)
    num_tokens, k = loc.shape
    t2r = check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(num_tokens,))
    ok = check_tensor("is_valid_token", is_valid_token, dtype=torch.bool, shape=(num_tokens,))
    bt = _check_block_table(block_table)
    lim = None
    if entry_limit is not None:
        lim = check_tensor("entry_limit", entry_limit, dtype=torch.int32, ndim=1)
        if lim.shape[0] < num_tokens:
            raise ValueError(f"entry_limit needs >= {num_tokens} entries, got {tuple(lim.shape)}")
        lim = lim[:num_tokens].contiguous()
    loc, t2r, ok = loc.contiguous(), t2r.contiguous(), ok.contiguous()
    dev = same_device(topk_local=loc, token_to_req=t2r, block_table=bt, is_valid_token=ok,
                      out=out, lens_out=lens_out, entry_limit=lim)
    if out is None:
        out = torch.empty(num_tokens, k, dtype=torch.int32, device=dev)
    if lens_out is None:
        lens_out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    out = _check_out("out", out, num_tokens, k, torch.int32)
    lens = _check_out("lens_out", lens_out, num_tokens, None, torch.int32)
    if validate:
        _check_requests("token_to_req", t2r, bt.shape[0])
        _check_slot_range(bt, block_size)
    if resolve_impl(impl, dev) == "reference" or num_tokens == 0 or k == 0:
        return R.compute_global_topk_indices_and_lens_ref(loc, t2r, bt, block_size, ok, out, lens, lim)
    K._global_topk_kernel[(num_tokens,)](
        loc, loc.stride(0), t2r, bt, bt.stride(0), bt.stride(1), bt.shape[1], block_size, ok,
        out, out.stride(0), lens, k, lim if lim is not None else t2r,
        HAS_LIMIT=lim is not None, BLOCK_K=min(1024, triton.next_power_of_2(k)),
    )
    return out[:num_tokens, :k], lens[:num_tokens]


def _range_inputs(positions: object, slot_mapping: object, validate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    pos = check_tensor("positions", positions, dtype=_INT, ndim=1)
    sm = check_tensor("slot_mapping", slot_mapping, dtype=_INT, shape=(pos.shape[0],))
    return pos.contiguous(), sm.contiguous()


def compute_swa_ranges(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    window_size: int,
    starts_out: torch.Tensor | None = None,
    lengths_out: torch.Tensor | None = None,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA range form: ``(starts int32 [T], lengths int32 [T])``; no index rows.

    ``starts = max(0, p - W + 1)``, ``lengths = p + 1 - starts`` (0 when ``slot_mapping < 0``).
    Token t sees SWA entries ``starts..starts+lengths-1`` of its request (see the interface
    contract in ``dsv4attn.metadata``).
    """
    _check_int("window_size", window_size, 1)
    pos, sm = _range_inputs(positions, slot_mapping, validate)
    num_tokens = pos.shape[0]
    dev = same_device(positions=pos, slot_mapping=sm, starts_out=starts_out, lengths_out=lengths_out)
    if validate:
        check_values("positions", pos, None, MAX_POSITION)
    if starts_out is None:
        starts_out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    if lengths_out is None:
        lengths_out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    st = _check_out("starts_out", starts_out, num_tokens, None, torch.int32)
    ln = _check_out("lengths_out", lengths_out, num_tokens, None, torch.int32)
    if resolve_impl(impl, dev) == "reference" or num_tokens == 0:
        return R.compute_swa_ranges_ref(pos, sm, window_size, st, ln)
    block = 1024
    K._ranges_kernel[(triton.cdiv(num_tokens, block),)](
        pos, sm, st, ln, num_tokens, window_size, 1, IS_WINDOW=True, BLOCK=block
    )
    return st[:num_tokens], ln[:num_tokens]


def compute_c128a_range_lengths(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    compress_ratio: int,
    lengths_out: torch.Tensor | None = None,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """C128A range form: ``lengths int32 [T] = (p + 1) // compress_ratio`` (0 when
    ``slot_mapping < 0``). Starts are all 0, so the builder hands out a persistent zero buffer and
    writes no starts per step.
    """
    _check_int("compress_ratio", compress_ratio, 1)
    pos, sm = _range_inputs(positions, slot_mapping, validate)
    num_tokens = pos.shape[0]
    dev = same_device(positions=pos, slot_mapping=sm, lengths_out=lengths_out)
    if validate:
        check_values("positions", pos, None, MAX_POSITION)
    if lengths_out is None:
        lengths_out = torch.empty(num_tokens, dtype=torch.int32, device=dev)
    ln = _check_out("lengths_out", lengths_out, num_tokens, None, torch.int32)
    if resolve_impl(impl, dev) == "reference" or num_tokens == 0:
        return R.compute_c128a_range_lengths_ref(pos, sm, compress_ratio, ln)
    block = 1024
    K._ranges_kernel[(triton.cdiv(num_tokens, block),)](
        pos, sm, ln, ln, num_tokens, 1, compress_ratio, IS_WINDOW=False, BLOCK=block
    )
    return ln[:num_tokens]
