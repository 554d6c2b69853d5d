"""Kernel launch policy of the sparse MLA attention: which kernel, tile sizes, split-KV.

:func:`launch` runs the Triton kernels on validated inputs (callers: the op in
:mod:`dsv4attn.ops.sparse_attn`, scripts and tests that time or pin a config): the Gluon sm90
kernel (:mod:`dsv4attn.kernels.sparse_attn_sm90`) where :func:`uses_sm90` says it applies, the
portable kernels (:mod:`dsv4attn.kernels.sparse_attn`, :mod:`dsv4attn.kernels.sparse_attn_prefill`)
elsewhere, and the split-KV combine. Per-shape decisions are pure functions of shapes, dtypes,
layouts and the device, cached (LRU) to keep the host cost of an eager call low.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4attn.device import sm_count
from dsv4attn.kv_cache.layout import FP8DSMLALayout
from dsv4attn.ops import call_plan, launch_cache
from dsv4attn.ops.candidate_set import CandidateSet, layout_for

_INT32_MAX = 2**31 - 1
#: Split-KV model (:func:`pick_splits`), in units of one candidate chunk of a program: the fixed
#: cost of a program (prologue, first gathers, epilogue) and of the combine kernel.
_SPLIT_FIXED = 3.0
_COMBINE_COST = 1.0
#: Most candidate splits a token is cut into (each costs a partial write + read of h*D fp32).
_MAX_SPLITS = 16
#: Rows (tokens x heads) of one prefill tile; the shared-range kernel is used up to this many
#: heads (more heads already fill a per-token tile, whose entries L2 shares across tokens).
_PREFILL_ROWS = 64
_PREFILL_MAX_HEADS = 32
#: Prefill kernel launch (64-row tiles): 4 warps spill ~3x more than 8 on sm90.
_PREFILL_BLOCK_N = 32
_PREFILL_WARPS = 8


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the attention kernel (a pure function of shapes and device)."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    #: Online-softmax rescaling only when a row max grows by > 2^8 (never with max logits).
    lazy_rescale: bool = False
    #: Programs the 512-wide d_v is split across (1, or 2: dims [0, 256) and [256, 512) in two
    #: launches that each compute the full QK but keep half the accumulators).
    v_split: int = 1
    #: Software-pipelined gather (next chunk's page loads in flight during this chunk's MMAs).
    prefetch: bool = False
    #: Run the Gluon sm90 kernel (:mod:`dsv4attn.kernels.sparse_attn_sm90`) where it applies
    #: (:func:`uses_sm90`): Hopper, 64-head tiles, head dim 512, fp8 pages of the 448 + 64
    #: layout or bf16 pages.
    sm90: bool = False
    #: On fp8 pages, run the warp-specialised variant of the sm90 kernel
    #: (:mod:`dsv4attn.kernels.sparse_attn_sm90_ws`: a producer partition gathers and
    #: dequantises, warpgroup 0 computes S and the softmax, warpgroup 1 the other half of P V);
    #: False: the single-partition one.
    sm90_ws: bool = True
    #: On bf16 pages, run the warp-specialised kernel too (its producer copies rows with
    #: ``cp.async`` instead of dequantising); False: the single-partition one.
    sm90_ws_bf16: bool = True
    #: In the warp-specialised kernel, prefetch the next chunk's rows into L2 while this chunk
    #: is loaded (tuning switch; measured in scripts/attn_variants.py).
    sm90_l2_prefetch: bool = True
    #: On fp8 pages, the warp-specialised kernel's producer issues each half-chunk's loads half a
    #: chunk ahead of its dequantisation where a split has at least this many 64-candidate
    #: chunks, counted from the indices-form sets' widths (range-form sets count none): a chunk
    #: costs ~0.5 us less, a CTA ~2.7 us more on the H200 (docs/benchmarks.md, Table 36: 2-3%
    #: faster at 10 chunks, 10% slower at 5). 0: always; a huge value: never.
    sm90_pipe_min_chunks: int = 8
    #: On fp8 pages, the warp-specialised kernel's producer turns e4m3 bytes into bf16 by integer
    #: moves and bf16x2 multiplies (inline PTX, exact) instead of the e4m3 -> f16 -> f32 -> bf16
    #: conversions (tuning switch; measured in scripts/attn_variants.py).
    sm90_dequant_bits: bool = True
    #: On fp8 pages with 65-128 heads (two 64-head tiles), run a token's two tiles as one cluster
    #: of two CTAs in the warp-specialised kernel: each CTA's producer gathers and dequantises
    #: half of every chunk and writes it into both CTAs' K stages (``st.async``), so each row is
    #: read and dequantised once per token instead of twice (docs/design.md, "Attention kernel").
    #: Bit-identical to two separate CTAs and 3-7% faster than them at h128 on an H100, where the
    #: attention suites pass with it (docs/benchmarks.md, Tables 77-78): the default. False: two
    #: CTAs per token, each gathering every row.
    sm90_cluster: bool = True
    #: On fp8 pages with the loads ahead (``sm90_pipe_min_chunks``), the producer walks both
    #: candidate sets (when of one form) as one sequence of half-chunks, so that set B's lookups
    #: and first loads go out while set A's last chunk is dequantised (tuning switch).
    sm90_merge_sets: bool = False
    #: On fp8 pages, the warp-specialised kernel runs two producer warpgroups (16 warps), each
    #: loading and dequantising half of every chunk, instead of one that does all of it: twice the
    #: warps to hide the gathers' latency behind each other's dequantisation. Each consumer's half
    #: of O is then two 64 x 128 accumulators (a 16-warp kernel cannot hold a 64 x 256 one), and
    #: the producers' loads are never carried ahead: ``sm90_pipe_min_chunks`` and
    #: ``sm90_merge_sets`` apply to the one-producer kernel (False) only. With ``sm90_cluster`` the
    #: two producers of each CTA split its half of every chunk by 64-dim tiles. Bit-identical to it,
    #: 3-5% faster on the decode rows on an H100 (docs/benchmarks.md, Tables 53-54), and the
    #: attention suites pass with it in every dispatch: the default.
    sm90_dual_producer: bool = True
    #: On bf16 pages, run the q-in-registers kernel (:mod:`dsv4attn.kernels.sparse_attn_sm90_qreg`:
    #: warpgroup 0 holds q in registers and computes the logits one chunk ahead of the softmax;
    #: two other warpgroups each multiply half of ``P V`` and copy half the rows into three K
    #: stages) instead of the warp-specialised one. Same products in the same order, so
    #: bit-identical to it. On an H100 3-8% faster at 8 chunks per CTA on pages of 64 rows, 1-6%
    #: slower at 32, and 5-10% slower on FlashMLA's prefill rows (docs/benchmarks.md, Tables 56-57): off.
    sm90_bf16_qreg: bool = False
    #: In the q-in-registers kernel, each ``P V`` warpgroup copies its own 256 columns of every
    #: chunk's rows (refilled as soon as it has multiplied them) instead of half the rows of all
    #: columns (refilled once both have). Bit-identical too (tested on an H100). 5-9% faster than
    #: the warp-specialised kernel at 8 chunks per CTA on pages of 64 rows, level to 5% slower at
    #: 32, and 1.13-1.20x FlashMLA on its prefill rows against 1.08-1.10x (docs/benchmarks.md,
    #: Table 59): off.
    sm90_qreg_col_copies: bool = False
    #: Profiling only (scripts/attn_variants.py): parts of the single-partition sm90 kernel to
    #: skip (1 dequant, 2 MMAs, 4 page gathers); 0 in every production config.
    sm90_skip: int = 0


def kernel_config_changes(spec: str) -> dict[str, bool | int]:
    """KernelConfig fields to change, from ``spec`` = ``"field=value,..."`` (values as Python
    literals, e.g. ``"sm90_cluster=False,num_splits=2"``; empty: none), as the benchmarks,
    profiling scripts and ``DSV4ATTN_TEST_KERNEL_CONFIG`` take them. Every name is checked against
    the fields and every value against the field's type before anything is changed: a name that
    is no field (one of a removed switch, say) is a ``ValueError`` naming it, a value of the
    wrong type a ``TypeError``."""
    fields = typing.get_type_hints(KernelConfig)  # every field is a bool or an int
    changes: dict[str, bool | int] = {}
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        name, eq, text = (x.strip() for x in item.partition("="))
        if not eq or not name:
            raise ValueError(f"kernel config change {item!r}: expected field=value")
        if name not in fields:
            raise ValueError(f"kernel config change {item!r}: KernelConfig has no field {name!r} "
                             f"(fields: {', '.join(sorted(fields))})")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"kernel config change {item!r}: {text!r} is not a Python literal") from None
        if type(value) is not fields[name]:  # bool is no int here, nor int a bool
            raise TypeError(f"kernel config change {item!r}: {name} takes {fields[name].__name__} values, "
                            f"got {type(value).__name__}")
        changes[name] = value
    return changes


def kernel_config(
    num_tokens: int, num_heads: int, head_dim: int, max_candidates: int, device: torch.device,
    num_splits: int | None = None, deterministic: bool = False,
) -> KernelConfig:
    """Pick tile sizes (edit here to retune; ``benchmarks/bench_sparse_attn.py --sweep`` times
    the alternatives). All heads of a tile share one dequantisation per entry (h = 128 runs two
    64-head tiles, i.e. dequantises each entry twice); split-KV only when ``num_tokens *
    head_tiles`` cannot fill the GPU. Small head tiles run 4 warps (Triton 3.6 miscompiled the
    16-head tile at 8 warps with 16-wide chunks). ``deterministic``: no split-KV unless
    ``num_splits`` is given, so nothing depends on the batch size. A given ``num_splits`` is
    capped at ``_MAX_SPLITS`` (16; the combine loads all partials of a row at once)."""
    block_h = min(64, max(16, 1 << (num_heads - 1).bit_length()))
    # H200, 448 + 64 (scripts/attn_variants.py, 2026-11-30): 64-head tiles at 8 warps run
    # 11-13% faster with 64-wide chunks than with 32 (h64 B256 217 vs 246 us); smaller tiles
    # keep 32 (measured earlier; their 8-warp 16-wide variant miscompiled on Triton 3.6).
    block_n = 64 if block_h == 64 or head_dim <= 256 else 32
    num_warps = 8 if block_h >= 32 and head_dim > 128 else 4
    num_stages = 1
    if num_splits is None:
        num_splits = 1
        if device.type == "cuda" and not deterministic:
            sms = sm_count(device)
            progs = max(1, num_tokens * math.ceil(num_heads / block_h))
            num_splits = pick_splits(progs, sms, max(1, math.ceil(max_candidates / block_n)), _MAX_SPLITS)
    return KernelConfig(block_h, block_n, min(int(num_splits), _MAX_SPLITS), num_warps, num_stages,
                        sm90=block_h == 64 and head_dim == 512 and sm90_kernel_available(device))


@functools.lru_cache(maxsize=None)
def sm90_kernel_available(device: torch.device) -> bool:
    """True on Hopper (compute capability 9.x) when Triton's Gluon sm90 API imports (Triton
    3.6 or a compatible release); the portable kernel runs everywhere else."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        from dsv4attn.kernels import sparse_attn_sm90  # noqa: F401
    except Exception:  # pragma: no cover - depends on the Triton release
        return False
    return True


def pick_splits(programs: int, slots: int, chunks: int, max_splits: int = 16) -> int:
    """Split-KV factor in ``1..min(max_splits, chunks)`` with the least modelled time for
    ``programs`` (token, head-tile) programs of ``chunks`` candidate chunks each, on ``slots``
    concurrent program slots (one per SM: the 448 + 64 kernels use all registers). In units of
    one chunk: ``waves(s) * (_SPLIT_FIXED + ceil(chunks / s)) + (s > 1) * _COMBINE_COST``; the
    constants are fitted to the H200 sweep (``scripts/split_sweep.py``): a program's prologue,
    first gathers and epilogue cost about three chunks, the combine about one. Ties go to
    fewer splits. E.g. 132 SMs, 10 chunks: 64 programs -> 2, >= 128 -> 1, 1 -> 10."""
    def cost(s: int) -> float:
        return math.ceil(programs * s / slots) * (_SPLIT_FIXED + math.ceil(chunks / s)) + (s > 1) * _COMBINE_COST

    best, best_cost = 1, cost(1)
    for s in range(2, max(1, min(max_splits, chunks)) + 1):
        c = cost(s)
        if c < best_cost - 1e-9:
            best, best_cost = s, c
    return best


def geometry(head_dim: int, nope_dim: int | None) -> dict:
    """Head-dim parts of the kernels (see :mod:`dsv4attn.kernels.sparse_attn`): NoPE dims
    ``[0, nope)`` cut into at most three power-of-two parts of 64..256 dims (448 = 256 + 128 +
    64), the tail ``[nope, head_dim)`` as one part padded to a power of two >= 16. ``nope_dim``
    comes from the fp8 layout; ``None`` (bf16 pages only): the largest multiple of 64.
    Raises ``ValueError`` when the NoPE dims need more than three parts, an fp8 layout more than
    8 scale tiles (the kernels read them as two 32-bit words), or the tail exceeds 64."""
    nope = nope_dim if nope_dim is not None else head_dim // 64 * 64
    tail = head_dim - nope
    parts, left = [], nope // 64
    while left:
        p = min(4, 1 << (left.bit_length() - 1))
        parts.append(64 * p)
        left -= p
    if len(parts) > 3 or tail > 64 or (nope_dim is not None and nope > 512):
        raise ValueError(f"head_dim {head_dim} with {nope} NoPE dims is not supported by the kernels "
                         "(at most 3 power-of-two NoPE parts of <= 256 dims, <= 8 fp8 scale tiles, "
                         "<= 64 tail dims)")
    parts += [0] * (3 - len(parts))
    return dict(
        HEAD_DIM=head_dim, NOPE=nope, P0=parts[0], P1=parts[1], P2=parts[2],
        Z0=parts[0] or 16, Z1=parts[1] or 16, Z2=parts[2] or 16,
        TAIL=tail, R=max(16, 1 << max(0, tail - 1).bit_length()),
    )


# Host-cost caches (issue 9). Each wraps a pure function of its (hashable) arguments: shapes,
# dtypes, layouts, device ids, flags. No result depends on call history, only the time to get
# it; sizes are bounded (an LRU of a few hundred entries) so a shape sweep cannot grow memory.
_CACHE_SIZE = 512


def set_layout(s: CandidateSet, head_dim: int, i: int) -> FP8DSMLALayout | None:
    """:func:`resolve_layout` of ``sets[i]`` through its cached pure core."""
    return layout_for(s.layout, head_dim, int(s.cache.shape[2]), f"sets[{i}]") if s.is_fp8 else None


@functools.lru_cache(maxsize=_CACHE_SIZE)
def common_layout(lays: tuple, head_dim: int) -> FP8DSMLALayout | None:
    """The one fp8 layout of the sets (None: bf16/fp32 pages only); raises ``ValueError`` for
    mixed layouts, rope_dim > 64 or a head_dim the kernels do not support."""
    fp8_layouts = {x for x in lays if x is not None}
    if len(fp8_layouts) > 1:
        raise ValueError(f"all fp8 sets must share one layout, got {sorted(map(str, fp8_layouts))}")
    if any(lay.rope_dim > lay.tile for lay in fp8_layouts):
        raise ValueError(f"fp8 layouts with rope_dim > 64 are not supported, got {fp8_layouts}")
    lay = next(iter(fp8_layouts), None)
    geometry(head_dim, lay.nope_dim if lay else None)  # raises if unsupported
    return lay


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _geo(head_dim: int, lay: FP8DSMLALayout | None, out_bf16: bool, cpu: bool) -> dict:
    """Geometry constexprs of the kernels (callers never mutate the returned dict)."""
    return dict(
        geometry(head_dim, lay.nope_dim if lay else None),
        DATA_BYTES=lay.data_bytes if lay else 0, SCALE_BYTES=lay.scale_bytes if lay else 0,
        OUT_BF16=out_bf16,
        CPU_INTERP=cpu,  # interpreter workarounds (see the kernel module)
    )


#: :func:`kernel_config` through an LRU (its device argument carries the index, so the SM
#: count it reads is that device's).
_cached_config = functools.lru_cache(maxsize=_CACHE_SIZE)(lambda *a: kernel_config(*a))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _decode_constexprs(cfg: KernelConfig, geo_key: tuple, flags: tuple, v_mask: int) -> dict:
    """Keyword arguments (constexprs, warps) of one decode launch; ``geo_key`` the arguments of
    :func:`_geo`, ``flags`` (A_FP8, A_RANGE, HAS_B, B_FP8, B_RANGE, HAS_SINK, WRITE_MAX,
    WRITE_PARTIAL, A_LEN, B_LEN)."""
    a_fp8, a_range, has_b, b_fp8, b_range, has_sink, write_max, write_partial, a_len, b_len = flags
    return dict(
        A_FP8=a_fp8, A_RANGE=a_range, HAS_B=has_b, B_FP8=b_fp8, B_RANGE=b_range,
        HAS_SINK=has_sink, WRITE_MAX=write_max, WRITE_PARTIAL=write_partial,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, LAZY=cfg.lazy_rescale and not write_max,
        V_MASK=v_mask, PREFETCH=cfg.prefetch, A_LEN=a_len, B_LEN=b_len,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_geo(*geo_key),
    )


@functools.cache
def _kernel_modules():
    """The decode and prefill kernel modules, imported on first use (Triton stays out of
    ``import dsv4attn``); the cache only saves the import statement's cost per call."""
    from dsv4attn.kernels import sparse_attn, sparse_attn_prefill

    return sparse_attn, sparse_attn_prefill


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a ConstexprFunction: ~2 us per host call


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _set_args(s: CandidateSet) -> list:
    """Kernel arguments of one set (dummy tensors stand in for the unused form's fields)."""
    c = s.cache
    c_stride = c.stride()
    if s.is_range:
        assert s.block_table is not None  # range form (check_candidate_set proved its fields)
        idx, stride_idx, width = s.lengths, 0, _INT32_MAX
        bt, stride_bt, max_blocks = s.block_table, s.block_table.stride(0), s.block_table.shape[1]
        req, start, num_reqs = s.token_to_req, s.starts, s.block_table.shape[0]
    else:
        assert s.indices is not None  # indices form
        idx, stride_idx, width = s.indices, s.indices.stride(0), s.indices.shape[1]
        bt, stride_bt, max_blocks, req, start, num_reqs = idx, 0, 0, idx, idx, 0
    lengths = s.lengths if s.lengths is not None else s.indices  # no lengths: never read (A_LEN/B_LEN)
    return [c, c_stride[0], c_stride[1], s.block_size, s.capacity,
            idx, stride_idx, width, lengths, bt, stride_bt, max_blocks, num_reqs, req, start]


def _static_width(s: CandidateSet) -> int:
    """Upper bound on a token's candidates of ``s`` known without reading device data."""
    if s.indices is not None:
        return s.indices.shape[1]
    assert s.block_table is not None  # range form
    return s.block_table.shape[1] * s.block_size


def launch(
    q: torch.Tensor,
    sets: Sequence[CandidateSet],
    softmax_scale: float,
    attn_sink: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_logits: torch.Tensor | None,
    num_splits: int | None,
    config: KernelConfig | None = None,
    prefill: bool = False,
    deterministic: bool = False,
    layout: FP8DSMLALayout | None | bool = False,
) -> None:
    """Run the Triton kernels: per-token (split-KV + combine when the config asks for splits),
    or for ``prefill`` with <= 32 heads the shared-range kernel for range-form sets (merged with
    a per-token pass over indices-form sets). ``layout``: the sets' fp8 layout when the caller
    has resolved it (``False``: resolve here). Per-shape decisions come from the caches above."""
    kernels = _kernel_modules()[0]

    num_tokens, num_heads, head_dim = q.shape
    if layout is False:
        layout = common_layout(tuple(set_layout(s, head_dim, i) for i, s in enumerate(sets)), head_dim)
    device = q.device
    geo_key = (head_dim, layout, out.dtype == torch.bfloat16, device.type == "cpu")
    geo = _geo(*geo_key)
    cfg = config or _cached_config(num_tokens, num_heads, head_dim, sum(_static_width(s) for s in sets), device,
                                   num_splits, deterministic)
    has_sink = attn_sink is not None
    sink = attn_sink if has_sink else lse
    shared = (prefill and num_heads <= _PREFILL_MAX_HEADS and max_logits is None and not deterministic
              and any(s.is_range for s in sets))
    if shared:
        range_sets: Sequence[CandidateSet] = [s for s in sets if s.is_range]
        index_sets: Sequence[CandidateSet] = [s for s in sets if not s.is_range]
        passes = [("shared", range_sets)] + ([("per_token", index_sets)] if index_sets else [])
        total = len(passes)
    else:
        passes = [("per_token", sets)]
        total = cfg.num_splits
    if total > 1:
        if max_logits is not None:
            raise ValueError("max logits are only produced without split-KV (num_splits=1)")
        # One allocation for both partials: one allocation less per call. The lse part starts
        # 16-byte aligned, as a buffer of its own would.
        n_o = -(-num_tokens * total * num_heads * head_dim // 4) * 4
        part_o = call_plan.empty((n_o + num_tokens * total * num_heads,), torch.float32, device)
        part_lse = call_plan.tail(part_o, n_o)
    else:
        part_o = part_lse = lse
    qk_scale = softmax_scale * kernels.LOG2E
    for split_base, (kind, group) in enumerate(passes):
        if kind == "shared":
            _launch_prefill(q, group, out, lse, part_o, part_lse, sink, has_sink, qk_scale,
                            split_base, total, cfg, geo)
        else:
            _launch_decode(q, group, out, lse, max_logits, part_o, part_lse, sink, has_sink, qk_scale,
                           split_base, total, cfg if not shared else dataclasses.replace(cfg, num_splits=1), geo_key)
    if total > 1:
        launch_cache.launch(
            kernels._sparse_mla_combine_kernel, (num_tokens, num_heads),
            (part_o, part_lse, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), num_heads, total),
            dict(HEAD_DIM=head_dim, D_PAD=_next_pow2(head_dim), HAS_SINK=has_sink, OUT_BF16=geo["OUT_BF16"],
                 S_PAD=_next_pow2(total), CPU_INTERP=geo["CPU_INTERP"], num_warps=4))


def _launch_decode(q, sets, out, lse, max_logits, part_o, part_lse, sink, has_sink, qk_scale, split_base, total,
                   cfg: KernelConfig, geo_key: tuple) -> None:
    kernels = _kernel_modules()[0]

    num_tokens, num_heads, _ = q.shape
    a = sets[0]
    b = sets[1] if len(sets) > 1 else a
    mx = max_logits if max_logits is not None else lse
    grid = (num_tokens * _cdiv(num_heads, cfg.block_h), cfg.num_splits)
    flags = (a.is_fp8, a.is_range, len(sets) > 1, b.is_fp8, b.is_range, has_sink, max_logits is not None, total > 1,
             a.lengths is not None, b.lengths is not None)
    a_args = _set_args(a)
    b_args = _set_args(b) if b is not a else a_args
    # d_v split: part 0 (NoPE dims [0, P0)) in one launch, the other parts in a second one.
    masks = (15,) if cfg.v_split == 1 or _geo(*geo_key)["P1"] == 0 else (1, 14)
    # The runtime arguments, the same for both kernels (their constexprs differ).
    args = (q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), lse, lse.stride(0), mx, mx.stride(0),
            part_o, part_lse, sink, *a_args, *b_args, num_heads, qk_scale, split_base, total, cfg.num_splits)
    if uses_sm90(cfg, sets, geo_key[1]) and not _sm90_failures:
        ws = cfg.sm90_skip == 0 and (cfg.sm90_ws if a.is_fp8 else cfg.sm90_ws_bf16)
        qreg = ws and not a.is_fp8 and cfg.sm90_bf16_qreg
        kernel, warps = _sm90_kernel(ws, qreg)
        dual = ws and a.is_fp8 and cfg.sm90_dual_producer
        extra: dict[str, bool | int]  # each kernel's own constexprs
        if qreg:  # bf16 pages only: no page-kind or producer constexprs
            extra = dict(COL_COPIES=cfg.sm90_qreg_col_copies)
        elif ws:
            pipe = a.is_fp8 and not dual and _pipe_worth_it(sets, cfg)
            extra = dict(PAGES_BF16=not a.is_fp8, PREFETCH=cfg.sm90_l2_prefetch, PIPE=pipe,
                         DQ_BITS=cfg.sm90_dequant_bits,
                         MERGE=pipe and cfg.sm90_merge_sets and a.is_range == b.is_range, DUAL=dual)
        else:
            extra = dict(PAGES_BF16=not a.is_fp8, SKIP=cfg.sm90_skip)
        consts = dict(A_RANGE=a.is_range, HAS_B=len(sets) > 1, B_RANGE=b.is_range, HAS_SINK=has_sink,
                      WRITE_PARTIAL=total > 1, OUT_BF16=out.dtype == torch.bfloat16,
                      A_LEN=a.lengths is not None, B_LEN=b.lengths is not None, WRITE_MAX=max_logits is not None,
                      **extra)
        try:
            if (ws and a.is_fp8 and cfg.sm90_cluster and _cdiv(num_heads, cfg.block_h) == 2
                    and not _cluster_failures and _launch_cluster(kernel, warps, (num_tokens, cfg.num_splits), args,
                                                                  consts)):
                return
            launch_cache.launch(kernel, grid, args, dict(consts, num_warps=warps, num_stages=1))
            return
        except Exception as e:  # noqa: BLE001 - only compile / launch failures fall back
            if not _is_build_failure(e):
                raise
            _sm90_failures.append(f"{type(e).__name__}: {str(e)[:200]}")
            call_plan.clear()  # plans made before launch the sm90 kernel
            call_plan.not_plannable()
            warnings.warn(f"dsv4attn: the sm90 attention kernel could not be built or launched here "
                          f"({_sm90_failures[-1]}); this process uses the portable Triton kernel from now on",
                          RuntimeWarning, stacklevel=2)
    for v_mask in masks:
        launch_cache.launch(kernels._sparse_mla_attn_kernel, grid, args, _decode_constexprs(cfg, geo_key, flags, v_mask))


#: Compile or launch failures of the sm90 kernel in this process (e.g. a Triton release whose
#: Gluon API differs from the ones it was written for, 3.6 and 3.9): once one happened, every
#: launch takes the portable kernel (same contract and outputs), after one RuntimeWarning.
_sm90_failures: list[str] = []


#: Failures to build or launch the two-CTA cluster variant in this process: once one happened,
#: h128 runs two independent CTAs per token (the same kernel without the cluster).
_cluster_failures: list[str] = []
#: Byte offset of the K stages in the cluster kernel's shared memory, as the compiler placed them
#: (checked on every newly compiled specialisation; 0 with Triton 3.6 and 3.9).
_cluster_k_off = [0]
#: id of each compiled cluster kernel -> that kernel, once its launch metadata is set.
_cluster_ready: dict[int, object] = {}


def _launch_cluster(kernel, warps: int, grid: tuple, args: tuple, consts: dict) -> bool:
    """Launch the warp-specialised kernel with ``CLUSTER`` on ``grid`` = (tokens, splits)
    clusters of two CTAs. Triton 3.6's Gluon compiles one-CTA programs, so the kernel is
    compiled as one (``warmup``, which also finds the specialisation this call needs) and its
    launch metadata then asks for clusters of two (the launcher launches ``grid[0] * 2`` CTAs, in
    pairs, with the usual program ids) and 32 more bytes of dynamic shared memory for the
    cluster barriers. The K stages' offset, which the kernel's inline PTX needs, is read from the
    compiled kernel (the shared-memory allocation pass run on its TTGIR); the kernel is
    recompiled if it differs. The first launch of a specialisation does that; the launch cache
    keeps the compiled kernel (K_OFF is one of its constexprs, so a moved offset is a new key)
    and relaunches it directly, in call plans too. Returns False (after one warning) where this
    cannot be done: the caller then launches the kernel without the cluster, which raises again
    if the arguments were at fault."""
    kw = dict(consts, CLUSTER=True, K_OFF=_cluster_k_off[0])

    def build_and_launch():
        ck = _cluster_kernel(kernel, warps, grid, args, consts)  # may move _cluster_k_off: bind after it
        ck[(grid[0], grid[1], 1)](*_bound_values(kernel, args, dict(consts, CLUSTER=True, K_OFF=_cluster_k_off[0])))
        return ck

    try:
        launch_cache.launch(kernel, grid, args, dict(kw, num_warps=warps, num_stages=1), usual=build_and_launch)
    except Exception as e:  # noqa: BLE001 - any failure here falls back to one CTA per tile
        _cluster_failures.append(f"{type(e).__name__}: {str(e)[:200]}")
        call_plan.clear()
        warnings.warn(f"dsv4attn: the two-CTA cluster attention kernel could not be built or launched here "
                      f"({_cluster_failures[-1]}); this process runs h128 as two CTAs per token",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _cluster_kernel(kernel, warps: int, grid: tuple, args: tuple, consts: dict):
    """The compiled cluster kernel for this call's specialisation, its launch metadata set
    (once per compiled kernel); compiled again with the K stages' offset where it is not the
    one assumed."""
    for _ in range(2):
        kw = dict(consts, CLUSTER=True, K_OFF=_cluster_k_off[0])
        ck = kernel.warmup(*args, grid=grid, **kw, num_warps=warps, num_stages=1)
        if id(ck) in _cluster_ready:
            return ck
        off = _k_stage_offset(ck.asm["ttgir"])
        if off == _cluster_k_off[0]:
            nw, _, shared = ck.packed_metadata
            ck.packed_metadata = (nw, 2, -(-shared // 16) * 16 + 32)
            _cluster_ready[id(ck)] = ck
            return ck
        _cluster_k_off[0] = off
    raise RuntimeError("the K stages' shared-memory offset moved between two compilations")


def _k_stage_offset(ttgir: str) -> int:
    """Offset Triton's shared-memory allocation gives the K stages (the [2, 64, 512] bf16 buffer)
    in a compiled Gluon kernel: its allocation pass run again on the kernel's TTGIR."""
    import os
    import re
    import tempfile

    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
        f.write(ttgir)
    try:
        mod = ir.parse_mlir_module(f.name, ctx)
    finally:
        os.unlink(f.name)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    try:
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
    except TypeError:  # Triton 3.6
        passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 80)
    pm.run(mod, "dsv4attn_k_offset")
    found = re.findall(r"allocation\.offset = (\d+) : i32\} : \(\) -> !ttg\.memdesc<2x64x512xbf16", str(mod))
    if len(found) != 1:
        raise RuntimeError(f"cannot find the K stages' allocation in the compiled kernel ({len(found)} matches)")
    return int(found[0])


def _bound_values(kernel, args: tuple, consts: dict) -> list:
    """Every parameter of ``kernel`` in order (runtime ``args``, then constexprs from ``consts``
    or their defaults), as Triton's launcher takes them."""
    return [*args, *launch_cache.bound_tail(kernel, len(args), consts)]


def _pipe_worth_it(sets: Sequence[CandidateSet], cfg: KernelConfig) -> bool:
    """Whether the fp8 producer should load half a chunk ahead: a split has at least
    ``cfg.sm90_pipe_min_chunks`` chunks known from the host. An indices-form set's width bounds
    its candidates; a range-form set (a sliding window) counts none, its bound (the block
    table's width) being far above what it holds."""
    chunks = sum(_cdiv(s.indices.shape[1], cfg.block_n) for s in sets if s.indices is not None)
    return chunks >= cfg.sm90_pipe_min_chunks * cfg.num_splits


def _sm90_kernel(ws: bool, qreg: bool = False):
    """The Gluon sm90 kernel (``ws``: the warp-specialised one; ``qreg``: the q-in-registers one
    of bf16 pages) and the warp count it is launched with (imported on first use)."""
    if qreg:
        from dsv4attn.kernels import sparse_attn_sm90_qreg as mq

        return mq._sparse_mla_attn_sm90_qreg_kernel, mq.NUM_WARPS
    if ws:
        from dsv4attn.kernels import sparse_attn_sm90_ws as m

        return m._sparse_mla_attn_sm90_ws_kernel, m.NUM_WARPS
    from dsv4attn.kernels.sparse_attn_sm90 import NUM_WARPS, _sparse_mla_attn_sm90_kernel

    return _sparse_mla_attn_sm90_kernel, NUM_WARPS


def _is_build_failure(e: Exception) -> bool:
    """A Triton compile error (front end or MLIR/ptxas back end, which raise RuntimeError) or a
    launch refused by the driver, as opposed to a bug in the caller's arguments."""
    return type(e).__name__ == "CompilationError" or isinstance(e, RuntimeError)


def uses_sm90(cfg: KernelConfig, sets: Sequence[CandidateSet], layout: FP8DSMLALayout | None) -> bool:
    """Whether a per-token launch runs the Gluon sm90 kernel: the config allows it (Hopper,
    64-head tiles, head dim 512, no d_v split / prefetch / lazy variant) and the pages are all
    fp8 of the production layout (448 NoPE + 64 RoPE dims,
    64-dim tiles, 576 data and 8 scale bytes per entry) or all bf16 (512 contiguous values per
    entry), with 16-byte aligned rows (its gathers are 16-byte cp.async copies). Everything
    else runs the portable kernel."""
    if not (cfg.sm90 and cfg.v_split == 1 and not cfg.prefetch and not cfg.lazy_rescale):
        return False
    if all(s.is_fp8 for s in sets):
        return (layout is not None and layout.nope_dim == 448 and layout.rope_dim == 64 and layout.tile == 64
                and layout.data_bytes == 576 and layout.scale_bytes == 8 and all(_aligned16(s, 1) for s in sets))
    return all(s.cache.dtype == torch.bfloat16 and s.cache.stride(-1) == 1 and _aligned16(s, 2) for s in sets)


def _aligned16(s: CandidateSet, elem_bytes: int) -> bool:
    """Block and entry strides multiples of 16 elements and a 16-byte aligned base (what lets
    Triton prove 16-byte aligned rows)."""
    c = s.cache
    return c.data_ptr() % 16 == 0 and c.stride(0) % 16 == 0 and (elem_bytes == 1 or c.stride(1) % 16 == 0)


def _launch_prefill(q, sets, out, lse, part_o, part_lse, sink, has_sink, qk_scale, split_base, total,
                    cfg: KernelConfig, geo: dict) -> None:
    kernels = _kernel_modules()[1]

    num_tokens, num_heads, _ = q.shape
    block_h = _next_pow2(num_heads)
    block_m = max(1, _PREFILL_ROWS // block_h)

    def args(s: CandidateSet) -> list:
        c = s.cache
        assert s.block_table is not None  # shared pass: range-form sets only
        return [c, c.stride(0), c.stride(1), s.block_size, s.capacity, s.lengths, s.block_table,
                s.block_table.stride(0), s.block_table.shape[1], s.block_table.shape[0], s.token_to_req, s.starts]

    a = sets[0]
    b = sets[1] if len(sets) > 1 else sets[0]
    grid = (_cdiv(num_tokens, block_m), _cdiv(num_heads, block_h))
    launch_cache.launch(
        kernels._sparse_mla_prefill_kernel, grid,
        (q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), lse, lse.stride(0), part_o, part_lse, sink,
         *args(a), *args(b), num_tokens, num_heads, qk_scale, split_base, total),
        dict(A_FP8=a.is_fp8, HAS_B=len(sets) > 1, B_FP8=b.is_fp8, HAS_SINK=has_sink, WRITE_PARTIAL=total > 1,
             BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=_PREFILL_BLOCK_N, num_warps=_PREFILL_WARPS, num_stages=1,
             **geo))
