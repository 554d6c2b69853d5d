"""FlashMLA-compatible entry points (sparse mode) mapped onto :func:`sparse_mla_attention`.

Same arguments, shapes and semantics as the FlashMLA Python API's sparse paths, so code written
against ``flash_mla`` can switch by changing the import:

* :func:`get_mla_metadata` returns ``(FlashMLASchedMeta(), None)`` like FlashMLA's. It carries
  FlashMLA's fields; our kernels need no tile-scheduler table (``tile_scheduler_metadata``
  stays ``None``), ``num_splits`` holds the split-KV factor chosen at the first call, and the
  first call's shapes are recorded (FlashMLA's rule that one metadata object serves one shape
  is checked). A call that fails validation leaves the object untouched.
* Caches: fp8_ds_mla as ``uint8`` or as FlashMLA's own ``torch.float8_e4m3fn`` view of the same
  bytes, with the padded block stride of :mod:`dsv4attn.kv_cache.layout` or contiguous
  (``block_size * 584`` bytes per block, as engines' tests allocate them).
* ``out=`` (keyword) takes a preallocated output, as vLLM passes it.
* :func:`flash_mla_with_kvcache`: sparse decode over fp8_ds_mla paged caches (``indices``
  required; dense mode raises). ``lse`` is natural-log, ``(batch, num_heads, seq_len_q)``.
* :func:`flash_mla_sparse_fwd`: sparse attention over a flat bf16 ``kv``; returns
  ``(out, max_logits, lse)`` (natural log; empty rows: out 0, max_logits -inf, lse +inf).

Each takes an extra keyword-only ``impl`` ("auto" | "triton" | "reference"). On a GPU a call
whose signature has passed the checks before replays a plan of the op's launches on its own
tensors (:mod:`dsv4attn.ops.call_plan`), skipping the checks and set-up of both layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsv4attn._checks import check_tensor
from dsv4attn.ops import call_plan
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.ops.sparse_attn import plan_key, sparse_mla_forward
from dsv4attn.ops.sparse_attn_launch import kernel_config


@dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling-metadata object, with its fields (our kernels schedule themselves).

    ``config`` records ``(batch, seq_len_q, num_heads, block_size, topk, extra_block_size,
    extra_topk)`` of the first call it is used with; later calls with other shapes raise, as
    FlashMLA requires one metadata object per shape. ``tile_scheduler_metadata`` is always
    ``None`` (no tile table is needed); ``num_splits`` is a 1-element int32 CPU tensor with the
    split-KV factor of the first call (FlashMLA keeps a per-batch device tensor there).
    """

    have_initialized: bool = False
    config: tuple | None = field(default=None)
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """Return ``(FlashMLASchedMeta(), None)``; arguments are accepted and ignored (as FlashMLA)."""
    return FlashMLASchedMeta(), None


def _lengths(name: str, topk_length: torch.Tensor | None, batch: int, s_q: int, device) -> torch.Tensor | None:
    """:func:`_per_token` of a per-batch ``topk_length`` after checking it (int32 ``[batch]``)."""
    if topk_length is not None:
        check_tensor(name, topk_length, dtype=torch.int32, shape=(batch,), device=device)
    return _per_token(topk_length, s_q)


def _per_token(topk_length: torch.Tensor | None, s_q: int) -> torch.Tensor | None:
    """Per-token lengths ``[batch * s_q]`` from per-batch ones; ``None`` (whole rows, no vector
    to allocate) stays ``None``."""
    if topk_length is None:
        return None
    return topk_length.repeat_interleave(s_q) if s_q > 1 else topk_length


def _paged_set(name: str, cache: torch.Tensor, indices: torch.Tensor | None, lengths_arg, batch: int, s_q: int,
               is_fp8: bool, device) -> CandidateSet:
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[2] != 1:
        shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise ValueError(f"{name} must be (num_blocks, block_size, 1, bytes_or_dim), got {shape}")
    if is_fp8 != (cache.dtype in (torch.uint8, torch.float8_e4m3fn)):
        raise TypeError(f"{name} dtype {cache.dtype} does not match is_fp8_kvcache={is_fp8}")
    if cache.dtype == torch.float8_e4m3fn:  # FlashMLA's dtype for the same bytes
        cache = cache.view(torch.uint8)
    indices = check_tensor(f"{name} indices", indices, dtype=torch.int32, ndim=3, device=device)
    if indices.shape[:2] != (batch, s_q):
        raise ValueError(f"{name} indices must be (batch={batch}, seq_len_q={s_q}, topk), got {tuple(indices.shape)}")
    topk = indices.shape[2]
    lens_name = "topk_length" if name == "k_cache" else "extra_topk_length"
    lengths = _lengths(lens_name, lengths_arg, batch, s_q, device)
    return CandidateSet(cache=cache.select(2, 0), lengths=lengths, indices=indices.reshape(batch * s_q, topk))


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode, FlashMLA's signature. q ``(batch, seq_len_q, num_heads, head_dim)`` bf16;
    k_cache ``(num_blocks, block_size, 1, 584)`` uint8 fp8_ds_mla (``unsqueeze`` of the padded
    view; ``is_fp8_kvcache=False`` accepts bf16 pages ``(..., 1, head_dim)``); indices
    ``(batch, seq_len_q, topk)`` int32 global slots (-1 = hole); ``topk_length (batch,)``
    int32 limits each row (None = full); the ``extra_*`` set is a second cache attended in the
    same softmax; ``attn_sink (num_heads,)`` fp32. ``block_table``/``cache_seqlens`` are unused.
    ``out``: optional preallocated ``(batch, seq_len_q, num_heads, head_dim_v)`` bf16 output.

    Returns ``out (batch, seq_len_q, num_heads, head_dim_v)`` bf16 and ``lse (batch, num_heads,
    seq_len_q)`` fp32 (natural log, +inf for rows without a valid candidate; the sink does not
    change lse). Dense mode (``indices=None``) and ``causal=True`` raise ``ValueError``.
    """
    key = plan_key("flash_mla_with_kvcache", q, [], k_cache, indices, attn_sink, extra_k_cache,
                   extra_indices_in_kvcache, topk_length, extra_topk_length, out, head_dim_v,
                   tile_scheduler_metadata.__class__, num_splits, softmax_scale, causal, is_fp8_kvcache, impl)
    if key is not None:
        kept = call_plan.get(key)
        meta = tile_scheduler_metadata
        if kept is not None and (not meta.have_initialized or meta.config == kept[1]):
            plan, config, splits, shaped = kept
            s_q = q.shape[1]  # the signature passed the checks: lengths are per-batch int32 vectors
            res, lse, _ = plan.run(_kvcache_roles(
                q, attn_sink, out, k_cache, _per_token(topk_length, s_q), indices, extra_k_cache,
                _per_token(extra_topk_length, s_q), extra_indices_in_kvcache))
            if not meta.have_initialized:
                meta.have_initialized, meta.config = True, config
                meta.num_splits = torch.tensor([splits], dtype=torch.int32)
            return (res, lse) if shaped else _with_kvcache_outputs(res, lse, q.shape, head_dim_v)
    if indices is None:
        raise ValueError("flash_mla_with_kvcache: only sparse mode (indices given) is implemented; "
                         "dense paged MLA is not part of dsv4attn")
    if causal:
        raise ValueError("causal must be False in sparse mode")
    if num_splits is not None:
        raise ValueError("num_splits must be None (FlashMLA's interface keeps it as a placeholder)")
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata must come from dsv4attn.get_mla_metadata()")
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4)
    batch, s_q, num_heads, head_dim = q.shape
    if not isinstance(head_dim_v, int) or not 0 < head_dim_v <= head_dim:
        raise ValueError(f"head_dim_v must be an int in 1..{head_dim}, got {head_dim_v!r}")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together")
    device = q.device
    sets = [_paged_set("k_cache", k_cache, indices, topk_length, batch, s_q, is_fp8_kvcache, device)]
    if extra_k_cache is not None:
        sets.append(_paged_set("extra_k_cache", extra_k_cache, extra_indices_in_kvcache, extra_topk_length, batch,
                               s_q, is_fp8_kvcache, device))
    elif extra_topk_length is not None:
        raise ValueError("extra_topk_length given without extra_k_cache")
    config = (batch, s_q, num_heads, k_cache.shape[1], indices.shape[-1],
              None if extra_k_cache is None else extra_k_cache.shape[1],
              None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
    meta = tile_scheduler_metadata
    if meta.have_initialized and meta.config != config:
        raise ValueError(f"tile_scheduler_metadata was first used with shapes {meta.config}, now {config}; "
                         "use one get_mla_metadata() object per shape")
    dst = _out_view("out", out, (batch, s_q, num_heads, head_dim_v), head_dim, device)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    call_plan.take_last()
    res, lse, _ = sparse_mla_forward(q.reshape(batch * s_q, num_heads, head_dim), sets, scale, attn_sink,
                                     None if dst is None else dst.view(batch * s_q, num_heads, head_dim), impl)
    if not meta.have_initialized:  # bound only once a call has passed validation
        widths = sum(s.indices.shape[1] for s in sets if s.indices is not None)  # all in indices form
        k = kernel_config(batch * s_q, num_heads, head_dim, widths, device).num_splits
        meta.have_initialized, meta.config = True, config
        meta.num_splits = torch.tensor([k], dtype=torch.int32)
    if out is not None and dst is None:  # out cannot be written in place: copied (no plan of its own)
        out.copy_(_with_kvcache_outputs(res, lse, q.shape, head_dim_v)[0])
        return out, lse.view(batch, s_q, num_heads).transpose(1, 2)
    final = _with_kvcache_outputs(res, lse, q.shape, head_dim_v)
    if key is not None and meta.num_splits is not None:  # the roles as the op saw them (per-token lengths)
        _keep_if_same_tensors(key, _kvcache_roles(
            q, attn_sink, out, k_cache, sets[0].lengths, indices, extra_k_cache,
            sets[-1].lengths if extra_k_cache is not None else None, extra_indices_in_kvcache),
            (config, int(meta.num_splits[0])), (res, lse, None), (*final, None))
    return final


def _kvcache_roles(q, attn_sink, out, k_cache, lengths, indices, extra_k_cache, extra_lengths,
                   extra_indices) -> list:
    """``flash_mla_with_kvcache``'s tensors in the order of the op's plan roles (q, sink, out,
    then per cache: cache, per-token lengths, indices and three unused range-form roles)."""
    roles = [q, attn_sink, out, k_cache, lengths, indices, None, None, None]
    if extra_k_cache is not None:
        roles += [extra_k_cache, extra_lengths, extra_indices, None, None, None]
    return roles


def _with_kvcache_outputs(res: torch.Tensor, lse: torch.Tensor, q_shape: torch.Size,
                          head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_mla_with_kvcache``'s outputs from the op's ``[tokens, heads, head_dim]`` out and
    ``[tokens, heads]`` lse: ``(batch, s_q, heads, head_dim_v)`` and ``(batch, heads, s_q)``."""
    batch, s_q, num_heads, head_dim = q_shape
    res = res.view(batch, s_q, num_heads, head_dim)
    if head_dim_v != head_dim:
        res = res[..., :head_dim_v]
    return res, lse.view(batch, s_q, num_heads).transpose(1, 2)


def _keep_if_same_tensors(key: tuple | None, roles: list, extra: tuple, made: tuple = (),
                          finals: tuple = ()) -> None:
    """Keep the plan the inner :func:`sparse_mla_forward` call just made under this entry
    point's ``key``, with ``extra`` values, when it can be run on this entry point's own
    tensors: each of ``roles`` is at the address the op saw in that role (the op received views
    of them, not copies). Equal signatures give equal answers, so the check holds for every
    later call with this key. With ``made`` (the op's outputs) and ``finals`` (this entry
    point's views of them), the kept plan returns the finals' shapes where it can
    (:meth:`~dsv4attn.ops.call_plan.CallPlan.shaped`), and a last extra value says whether it does."""
    plan = call_plan.take_last()
    if key is None or plan is None:
        return
    if tuple(0 if t is None else t.data_ptr() for t in roles) == plan.role_ptrs:
        if made:
            shaped = plan.shaped(made, finals, roles)
            plan, extra = (plan, (*extra, False)) if shaped is None else (shaped, (*extra, True))
        call_plan.keep(key, (plan, *extra))


def _out_view(name: str, out: torch.Tensor | None, shape: tuple, head_dim: int, device) -> torch.Tensor | None:
    """Check a caller's ``out`` of ``shape`` (bf16); return it when the kernels can write it in
    place (all ``head_dim`` dims, rows viewable as ``[tokens, heads, head_dim]``), else None
    (the result is then copied into it)."""
    if out is None:
        return None
    check_tensor(name, out, dtype=torch.bfloat16, shape=shape, device=device)
    if shape[-1] != head_dim or out.stride(-1) != 1:
        return None
    try:
        out.view(-1, shape[-2], head_dim)
    except RuntimeError:
        return None
    return out


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    indexer_topk: int = 0,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention over a flat KV, FlashMLA's signature. q ``[s_q, num_heads, d_qk]`` bf16;
    kv ``[s_kv, 1, d_qk]`` bf16; indices ``[s_q, 1, topk]`` int32 (invalid: -1 or >= s_kv);
    ``topk_length [s_q]`` int32 (None = full); ``attn_sink [num_heads]`` fp32.

    Returns ``out [s_q, num_heads, d_v]`` bf16 (the first ``d_v`` dims of ``sum p_j kv_j``,
    sink applied), ``max_logits [s_q, num_heads]`` fp32 (scaled; -inf for empty rows) and
    ``lse [s_q, num_heads]`` fp32 (natural log; +inf for empty rows). ``indexer_topk`` must be 0.
    ``out``: optional preallocated ``[s_q, num_heads, d_v]`` bf16 output (vLLM passes one).
    """
    key = plan_key("flash_mla_sparse_fwd", q, [], kv, indices, sm_scale, d_v, attn_sink, topk_length, indexer_topk,
                   out, impl)
    roles = [q, attn_sink, out, kv, topk_length, indices, None, None, None]
    if key is not None:
        kept = call_plan.get(key)
        if kept is not None:
            res, lse, max_logits = kept[0].run(roles)
            return (res if d_v == q.shape[2] else res[..., :d_v]), max_logits, lse
    if indexer_topk != 0:
        raise ValueError(f"indexer_topk must be 0 (the indexer-lse output is not implemented), got {indexer_topk!r}")
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    s_q, num_heads, d_qk = q.shape
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=3, device=q.device)
    if kv.shape[1] != 1 or kv.shape[2] != d_qk:
        raise ValueError(f"kv must be [s_kv, 1, d_qk={d_qk}], got {tuple(kv.shape)}")
    if kv.shape[0] == 0:
        raise ValueError("kv must hold at least one row")
    check_tensor("indices", indices, dtype=torch.int32, ndim=3, device=q.device)
    if indices.shape[:2] != (s_q, 1):
        raise ValueError(f"indices must be [s_q={s_q}, 1, topk], got {tuple(indices.shape)}")
    if not isinstance(d_v, int) or not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be an int in 1..{d_qk}, got {d_v!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise TypeError(f"sm_scale must be a finite float, got {sm_scale!r}")
    lengths = topk_length  # None: whole rows
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(s_q,), device=q.device)
    # kv as bf16 pages of one entry each: slot = row, capacity = s_kv (>= s_kv is invalid).
    dst = _out_view("out", out, (s_q, num_heads, d_v), d_qk, q.device)
    cset = CandidateSet(cache=kv, lengths=lengths, indices=indices.select(1, 0))
    call_plan.take_last()
    res, lse, max_logits = sparse_mla_forward(q, [cset], float(sm_scale), attn_sink, dst, impl, want_max=True)
    assert max_logits is not None  # want_max=True
    if d_v != d_qk:
        res = res[..., :d_v]
    if out is not None and dst is None:
        out.copy_(res)
        return out, max_logits, lse
    _keep_if_same_tensors(key, roles, ())
    return res, max_logits, lse
