"""Public op: sparse MLA attention with attention sink over paged caches (decode and prefill).

``sparse_mla_attention`` / ``sparse_mla_forward`` validate, allocate, then run the kernels
through :func:`dsv4attn.ops.sparse_attn_launch.launch` (kernel choice, tile sizes, split-KV) or
the PyTorch reference (:mod:`dsv4attn.reference.sparse_attn`), chosen by
:func:`dsv4attn.device.resolve_impl`. A call whose signature has passed the checks before
replays that call's plan (:mod:`dsv4attn.ops.call_plan`): the same allocations and compiled
launches on its own tensors, without the checks and set-up (the eager host cost).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from dsv4attn._checks import check_tensor
from dsv4attn.device import resolve_impl
from dsv4attn.ops import call_plan, launch_cache
from dsv4attn.ops.candidate_set import CandidateSet, check_candidate_set
from dsv4attn.ops.sparse_attn_launch import common_layout, launch, set_layout

#: Head-count limit (DeepSeek-V4 has 64 or 128 query heads per rank at most).
MAX_HEADS = 128


def sparse_mla_attention(
    q: torch.Tensor,
    sets: Sequence[CandidateSet],
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    *,
    num_splits: int | None = None,
    prefill: bool = False,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention (V == K) with an optional per-head attention sink.

    q ``[num_tokens, num_heads, head_dim]`` bf16 or fp32 (1 <= num_heads <= 128; head_dim and
    the NoPE/RoPE split come from the caches: production 448 + 64); ``sets``: one or two
    :class:`CandidateSet` (e.g. the SWA window and the compressed C4A/C128A entries);
    ``attn_sink [num_heads]`` fp32 or ``None``; ``out`` an optional preallocated
    ``[num_tokens, num_heads, head_dim]`` output of q's dtype (last dim contiguous).

    Returns ``(out [num_tokens, num_heads, head_dim] q.dtype, lse [num_tokens, num_heads] fp32)``.
    fp32 q: the Triton path still multiplies on bf16 tensor cores (q and the probabilities
    rounded to bf16, fp32 accumulation) but writes the output unrounded in fp32; the reference
    path computes and returns fp32 throughout. Semantics:
    for each token and head, logits ``softmax_scale * q . k_j`` over the valid candidates of
    all sets (one softmax; duplicates count twice), ``out = sum_j p_j k_j`` over all head_dim
    dims, ``lse`` the natural-log logsumexp. With a sink, ``out *= 1 / (1 + exp(sink_h -
    lse))`` and lse is unchanged (sink -inf: no effect; +inf: out = 0). A token with no valid
    candidate gets ``out = 0`` and ``lse = +inf``. Invalid candidates (-1, at or beyond the
    length, slot beyond the cache) are never dereferenced, so unused pages may hold anything.
    ``num_splits`` forces the split-KV factor of the Triton path (``None``: heuristic; at most
    16 are used).
    ``prefill=True`` says that consecutive tokens mostly belong to one request (prefill chunks):
    with <= 32 heads, range-form sets are then gathered once per block of tokens and shared
    (any token order stays correct, only slower). Results do not depend on these two knobs
    beyond fp32 rounding.

    ``deterministic=True`` makes results batch-invariant: a token's output bits depend only on
    its own query and candidates, never on which other tokens share the call. Every token is
    then one program per head tile over all its candidates in order (no split-KV unless
    ``num_splits`` is given, which the caller then holds fixed; no shared prefill gathers).
    The default (False) picks the split-KV factor from the grid size, i.e. from the batch
    size, so a token's output can change in the last fp32 bits with the batch composition
    (always within the tolerance of the tests); it is faster for small batches (decode h64
    B64: 36 vs 49 us on the H200, docs/benchmarks.md Table 11).
    """
    return sparse_mla_forward(q, sets, softmax_scale, attn_sink, out, impl, num_splits=num_splits, want_max=False,
                              prefill=prefill, deterministic=deterministic)[:2]


def sparse_mla_forward(
    q: torch.Tensor,
    sets: Sequence[CandidateSet],
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    *,
    num_splits: int | None = None,
    want_max: bool = False,
    prefill: bool = False,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`sparse_mla_attention` plus the max logit: returns ``(out [T, H, D], lse [T, H]
    fp32, max_logits [T, H] fp32 or None)``. With ``want_max=True`` the third output holds
    the scaled max logit per (token, head) (-inf for rows without a valid candidate) and the
    Triton path runs without split-KV (``num_splits`` must then be None or 1); otherwise it is
    ``None``. Same validation and arguments as the op (the FlashMLA entry points and the op
    both call this; its reference is ``sparse_mla_forward_ref``)."""
    key = plan_key("sparse_mla_forward", q, sets, softmax_scale, attn_sink, out, impl, num_splits, want_max,
                   prefill, deterministic)
    plan = None if key is None else call_plan.get(key)
    if plan is not None:
        res = plan.run(plan_roles(q, sets, attn_sink, out))
        return res[0], res[1], res[2]
    check_tensor("q", q, dtype=(torch.bfloat16, torch.float32), ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    if not 1 <= num_heads <= MAX_HEADS:
        raise ValueError(f"q must have 1..{MAX_HEADS} heads, got shape {tuple(q.shape)}")
    if q.stride(2) != 1:
        raise ValueError(f"q last dim must be contiguous, got strides {q.stride()}")
    device = q.device
    if not isinstance(sets, Sequence) or isinstance(sets, CandidateSet) or not 1 <= len(sets) <= 2:
        raise ValueError(f"sets must be a sequence of 1 or 2 CandidateSet, got {type(sets).__name__}")
    for i, s in enumerate(sets):
        check_candidate_set(f"sets[{i}]", s, num_tokens, head_dim, device)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    lay = common_layout(tuple(set_layout(s, head_dim, i) for i, s in enumerate(sets)), head_dim)  # raises
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(num_heads,), device=device)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=(num_tokens, num_heads, head_dim), device=device)
        if out.stride(2) != 1:
            raise ValueError(f"out last dim must be contiguous, got strides {out.stride()}")
    if not isinstance(prefill, bool):
        raise TypeError(f"prefill must be a bool, got {prefill!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if not isinstance(want_max, bool):
        raise TypeError(f"want_max must be a bool, got {want_max!r}")
    if want_max and num_splits not in (None, 1):
        raise ValueError(f"want_max needs num_splits None or 1 (max logits are not split), got {num_splits!r}")
    path = _resolve_impl(impl, device)
    # What the kernels read as flat int32 / fp32 vectors must be dense (a strided view would be
    # read as if it were not); no-ops for the usual contiguous tensors.
    dense = [_dense(s) for s in sets]
    sink = attn_sink if attn_sink is None or attn_sink.is_contiguous() else attn_sink.contiguous()
    if path == "reference":
        from dsv4attn.reference.sparse_attn import sparse_mla_forward_ref

        if out is None:
            out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=device)
        return sparse_mla_forward_ref(q, dense, float(softmax_scale), sink, out, want_max)
    if (key is not None and num_tokens > 0 and sink is attn_sink and all(d is s for d, s in zip(dense, sets))
            and call_plan.seen_before(key)):
        # Nothing copied: the kernels see the caller's own tensors, so a plan can replay them.
        # (Recorded at a signature's second call: one-off calls do not pay for a recording.)
        with call_plan.recording(plan_roles(q, dense, sink, out)) as rec:
            res = _allocate_and_launch(q, dense, float(softmax_scale), sink, out, num_splits, want_max,
                                       prefill, deterministic, lay)
            call_plan.finish(rec, key, res, device)
        return res
    return _allocate_and_launch(q, dense, float(softmax_scale), sink, out, num_splits, want_max, prefill,
                                deterministic, lay)


def _allocate_and_launch(q, sets, softmax_scale, attn_sink, out, num_splits, want_max, prefill, deterministic,
                         lay) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The Triton path on validated inputs: out (unless given), lse, max logits, then the kernels."""
    num_tokens, num_heads, head_dim = q.shape
    device = q.device
    if out is None:
        out = call_plan.empty((num_tokens, num_heads, head_dim), q.dtype, device)
    lse = call_plan.empty((num_tokens, num_heads), torch.float32, device)
    max_logits = call_plan.empty((num_tokens, num_heads), torch.float32, device) if want_max else None
    if num_tokens == 0:
        return out, lse, max_logits
    launch(q, sets, softmax_scale, attn_sink, out, lse, max_logits, 1 if want_max else num_splits,
           prefill=prefill, deterministic=deterministic, layout=lay)
    return out, lse, max_logits


def plan_key(entry: str, q: object, sets: object, *scalars: object) -> tuple | None:
    """The signature (:func:`dsv4attn.ops.call_plan.signatures`) of a call of ``entry`` with
    query ``q``, candidate ``sets`` and the other arguments ``scalars`` (tensors or plain
    values), or None where no plan can serve it: plans or the launch cache are off, the cache
    does not serve q's device, or ``sets`` is not a list or tuple of at most two :class:`CandidateSet` (the
    FlashMLA-compatible entry points pass none and their caches among ``scalars``)."""
    if not (call_plan.ENABLED and launch_cache.ENABLED) or not isinstance(q, torch.Tensor) or (
            q.device.type not in launch_cache.DEVICE_TYPES):
        return None
    if sets.__class__ not in (list, tuple) or len(sets) > 2:  # type: ignore[arg-type]
        return None
    sigs = call_plan.signatures
    set_sigs = []
    try:
        for s in sets:  # type: ignore[attr-defined]
            if s.__class__ is not CandidateSet:
                return None
            set_sigs.append(sigs((s.layout, s.cache, s.lengths, s.indices, s.block_table, s.token_to_req, s.starts)))
        return (entry, launch_cache.current_device(), sets.__class__, tuple(set_sigs), sigs((q, *scalars)))
    except (RuntimeError, TypeError, AttributeError):  # e.g. a tensor without storage: the checks name it
        return None


def plan_roles(q: torch.Tensor, sets: Sequence[CandidateSet], attn_sink: torch.Tensor | None,
               out: torch.Tensor | None) -> list:
    """The tensors of a call in the order its plan names them: q, sink, out, then per set its
    cache, lengths, indices, block table, token_to_req and starts (None where absent)."""
    roles = [q, attn_sink, out]
    for s in sets:
        roles += (s.cache, s.lengths, s.indices, s.block_table, s.token_to_req, s.starts)
    return roles


def _resolve_impl(impl: str, device: torch.device) -> str:
    """:func:`resolve_impl`, cached for CUDA devices (their capability never changes; the CPU
    answer reads Triton's interpreter flag and stays uncached)."""
    if device.type == "cuda" and isinstance(impl, str):
        return _resolve_impl_cuda(impl, device)
    return resolve_impl(impl, device)


@functools.lru_cache(maxsize=64)
def _resolve_impl_cuda(impl: str, device: torch.device) -> str:
    return resolve_impl(impl, device)


def _dense(s: CandidateSet) -> CandidateSet:
    """``s`` with contiguous per-token vectors (lengths, starts, token_to_req)."""
    fields = {k: getattr(s, k).contiguous() for k in ("lengths", "starts", "token_to_req")
              if getattr(s, k) is not None and not getattr(s, k).is_contiguous()}
    return dataclasses.replace(s, **fields) if fields else s

