"""Builders and an independent oracle for the sparse MLA attention (tests, GPU scripts).

Used by ``tests/test_sparse_attn*.py``, ``tests/test_flashmla_compat.py`` and
``scripts/gpu_attn_debug.py``; nothing here is on the serving path.

Builds adversarial candidate sets (permuted block tables, NaN-poisoned unused pages, huge
sentinels in unused block-table columns, -1 holes, NaN rows behind indices past the length) and
an independent fp64 oracle written from the semantics with plain Python loops over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsv4attn.kv_cache.layout import FP8DSMLALayout, dequantize_fp8_ds_mla, pages_of, quantize_fp8_ds_mla
from dsv4attn.ops.candidate_set import CandidateSet

SMALL_LAYOUT = FP8DSMLALayout(nope_dim=64, rope_dim=16)
PROD_LAYOUT = FP8DSMLALayout()
#: Block-table sentinel in columns a request does not use (must never be dereferenced).
SENTINEL_BLOCK = 1 << 30


@dataclass(frozen=True)
class SetSpec:
    """One candidate set to build: form ("indices" | "range"), page dtype, block size, widths."""

    form: str
    fp8: bool
    block_size: int
    width: int
    hole_frac: float = 0.15


@dataclass
class BuiltSet:
    cset: CandidateSet
    kdec: torch.Tensor  # [capacity, D] float64: decoded entry values (NaN in poisoned pages)
    slots: list[list[int]]  # per token: the valid global slots, in candidate order


def _fill_cache(num_blocks: int, spec: SetSpec, layout: FP8DSMLALayout, poisoned: list[int], gen, device):
    d = layout.head_dim
    x = torch.randn(num_blocks, spec.block_size, d, generator=gen)
    # Vary tile magnitudes so the UE8M0 scales differ per tile.
    mag = torch.pow(2.0, torch.randint(-3, 4, (num_blocks, spec.block_size, math.ceil(d / 64)), generator=gen).float())
    x = x * mag.repeat_interleave(64, dim=-1)[..., :d]
    if spec.fp8:
        cache = quantize_fp8_ds_mla(x, layout)
        kdec = dequantize_fp8_ds_mla(cache, layout).double().reshape(-1, d)
        pages = pages_of(cache, layout)
        for b in poisoned:
            pages[b] = 0xFF  # e4m3 NaN bytes, NaN bf16 RoPE, scale byte 255
    else:
        cache = x.to(torch.bfloat16)
        kdec = cache.double().reshape(-1, d)
        cache[poisoned] = float("nan")
    kdec = kdec.clone()
    for b in poisoned:
        kdec[b * spec.block_size : (b + 1) * spec.block_size] = float("nan")
    return cache.to(device) if not spec.fp8 else _to_device_fp8(cache, layout, device), kdec


def _to_device_fp8(cache: torch.Tensor, layout: FP8DSMLALayout, device) -> torch.Tensor:
    if torch.device(device).type == "cpu":
        return cache
    flat = pages_of(cache, layout).reshape(-1).to(device)
    return flat.as_strided(cache.shape, cache.stride())


def build_set(spec: SetSpec, num_tokens: int, token_to_req: list[int], layout: FP8DSMLALayout, gen,
              device, lengths: list[int] | None = None, starts: list[int] | None = None) -> BuiltSet:
    """A random set of ``spec`` for ``num_tokens`` tokens; ``lengths`` (and, range form,
    ``starts``) override the random ones."""
    bs = spec.block_size
    r = lambda n: int(torch.randint(0, max(n, 1), (1,), generator=gen))  # noqa: E731
    if lengths is None:
        lengths = [r(spec.width + 1) for _ in range(num_tokens)]
        if num_tokens > 1:
            lengths[0] = spec.width  # the full width crosses block and tile edges
    i32: dict[str, Any] = dict(dtype=torch.int32)
    if spec.form == "range":
        num_reqs = max(token_to_req) + 1 if token_to_req else 1
        stream = [spec.width + 5 + r(bs) for _ in range(num_reqs)]
        if starts is not None:
            for t in range(num_tokens):
                stream[token_to_req[t]] = max(stream[token_to_req[t]], starts[t] + lengths[t] + 1)
        need = [math.ceil(n / bs) for n in stream]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        poisoned = perm[sum(need):]
        max_blocks = max(need) + 2
        bt = torch.full((num_reqs, max_blocks), SENTINEL_BLOCK, **i32)
        p = 0
        for q_, n in enumerate(need):
            bt[q_, :n] = torch.tensor(perm[p : p + n], **i32)
            p += n
        if starts is None:
            starts = [r(stream[token_to_req[t]] - lengths[t] + 1) for t in range(num_tokens)]
        slots = []
        for t in range(num_tokens):
            req = token_to_req[t]
            slots.append([int(bt[req, e // bs]) * bs + e % bs for e in range(starts[t], starts[t] + lengths[t])])
        cache, kdec = _fill_cache(num_blocks, spec, layout, poisoned, gen, device)
        cset = CandidateSet(cache=cache, lengths=torch.tensor(lengths, **i32).to(device), block_table=bt.to(device),
                            token_to_req=torch.tensor(token_to_req, **i32).to(device),
                            starts=torch.tensor(starts, **i32).to(device), layout=layout if spec.fp8 else None)
        return BuiltSet(cset, kdec, slots)
    used = max(2, math.ceil(spec.width / bs))
    num_blocks = used + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    live, poisoned = perm[:used], perm[used:]
    width = spec.width
    idx = torch.empty(num_tokens, width, **i32)
    slots = []
    for t in range(num_tokens):
        row, ok = [], []
        for j in range(width):
            if j < lengths[t]:
                if float(torch.rand(1, generator=gen)) < spec.hole_frac:
                    row.append(-1)
                else:
                    s = live[r(used)] * bs + r(bs)
                    row.append(s)
                    ok.append(s)
            else:  # past the length: NaN rows, -1, or a slot beyond the cache
                row.append([poisoned[0] * bs + r(bs), -1, num_blocks * bs + 7][j % 3])
        idx[t] = torch.tensor(row, **i32)
        slots.append(ok)
    cache, kdec = _fill_cache(num_blocks, spec, layout, poisoned, gen, device)
    cset = CandidateSet(cache=cache, lengths=torch.tensor(lengths, **i32).to(device), indices=idx.to(device),
                        layout=layout if spec.fp8 else None)
    return BuiltSet(cset, kdec, slots)


def make_sink(num_heads: int, kind: str, gen) -> torch.Tensor | None:
    """``None`` or a sink per head: finite values near typical lse, with -inf/+inf mixed in."""
    if kind == "none":
        return None
    sink = torch.rand(num_heads, generator=gen) * 6.0 - 1.0
    if kind == "inf":
        sink[0::3] = float("-inf")
        sink[1::3] = float("inf")
    return sink


def oracle(q: torch.Tensor, built: list[BuiltSet], scale: float, sink: torch.Tensor | None,
           low_precision: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 semantics (``low_precision``: the same computation with fp32 logits, bf16 weights and
    a bf16 output: the "bf16 run" of the 2x tolerance rule). Returns out, lse on CPU."""
    q64 = q.detach().cpu().double()
    num_tokens, num_heads, d = q64.shape
    out = torch.zeros(num_tokens, num_heads, d, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), float("inf"), dtype=torch.float64)
    for t in range(num_tokens):
        rows = [b.kdec[torch.tensor(b.slots[t], dtype=torch.long)] for b in built if b.slots[t]]
        if not rows:
            continue
        k = torch.cat(rows)  # [n, D]
        if low_precision:
            s = (q64[t].float() @ k.float().T) * scale
            l_ = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - l_[:, None]).bfloat16().float()
            o = (p @ k.float()).double()
            l_ = l_.double()
        else:
            s = (q64[t] @ k.T) * scale
            l_ = torch.logsumexp(s, dim=-1)
            o = torch.exp(s - l_[:, None]) @ k
        if sink is not None:
            o = o / (1.0 + torch.exp(sink.double() - l_))[:, None]
        out[t] = o.bfloat16().double() if low_precision else o
        lse[t] = l_
    return out, lse


def assert_matches(out: torch.Tensor, lse: torch.Tensor, ref: tuple, base: tuple, what: str = "") -> None:
    """Kernel error vs the fp64 oracle <= 2x the bf16 run's error (+ a floor); inf/NaN match."""
    ref_o, ref_l = ref
    base_o, base_l = base
    out = out.detach().cpu().double()
    lse = lse.detach().cpu().double()
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_l)), f"{what}: lse inf positions differ"
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_l)), f"{what}: lse NaN positions differ"
    # Max error: floor of one bf16 ulp at the largest |out| (two correct fp32 results that
    # straddle a rounding boundary differ by one ulp after the bf16 cast, and the bf16 run may
    # happen to round the worst element exactly). Mean error: the statistically robust 2x rule
    # with a tiny floor (2^-16 of the output scale).
    amax = ref_o.abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(amax)) - 7) if amax > 0 else 0.0
    diff, bdiff = (out - ref_o).abs(), (base_o - ref_o).abs()
    err, berr = diff.max().item(), bdiff.max().item()
    assert err <= 2 * berr + ulp + 1e-30, f"{what}: max out error {err:.3g} > 2 x bf16-run {berr:.3g} + ulp {ulp:.3g}"
    merr, mberr = diff.mean().item(), bdiff.mean().item()
    mfloor = 2.0**-16 * amax + 1e-30
    assert merr <= 2 * mberr + mfloor, f"{what}: mean out error {merr:.3g} > 2 x bf16-run {mberr:.3g} + {mfloor:.3g}"
    fin = torch.isfinite(ref_l)
    if fin.any():
        lerr = (lse[fin] - ref_l[fin]).abs().max().item()
        lberr = (base_l[fin] - ref_l[fin]).abs().max().item()
        # lse floor: a few fp32 ulps of |lse| (online accumulation order differs from logsumexp).
        lfloor = 1e-5 * (ref_l[fin].abs().max().item() + 1.0)
        assert lerr <= 2 * lberr + lfloor, f"{what}: lse error {lerr:.3g} > 2 x {lberr:.3g} + {lfloor:.3g}"
