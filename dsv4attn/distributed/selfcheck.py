"""Parity check of the parallel runners against one process, run on every rank.

Used by the tests (spawned gloo / NCCL processes) and by
``torchrun ... -m dsv4attn.distributed --check``. A small DeepSeek-V4 layer of each kind
(sliding, CSA r=4, HCA r=128; 4 heads of 64 + 16 dims, 2 output groups, window 8, top-k 4) with
deterministic random weights serves several requests through a deterministic plan of mixed
prefill chunks and decodes (chunk ends on and next to every compression boundary, requests freed
and new ones admitted), once with a single-process ``AttentionRunner`` and once with this rank's
parallel runner (``make_runner``). Every rank compares; the verdicts are gathered to all ranks.

Tolerances: fp32 runs must agree within 1e-5 of the output's max magnitude (the paths differ only
in fp32 reduction order: the split head sums of the output projection, the lse merge; observed
~1e-7). bf16 runs follow the house rule: the parallel run's error against the fp32 single-process
run is at most twice the single-process bf16 run's error (plus 1e-6 of the max).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.distributed as dist

from dsv4attn.config import AttentionConfig
from dsv4attn.distributed.dcp import RESERVE_CHUNK, DCPAttentionRunner
from dsv4attn.distributed.launch import ParallelContext, make_runner
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner

KINDS = {"sliding": 0, "csa": 1, "hca": 2}
#: Request lengths per kind (HCA needs > 128 tokens per compressed entry).
LENGTHS = {"sliding": [37, 1, 61, 9, 24], "csa": [37, 1, 61, 9, 24, 50], "hca": [300, 140, 40]}
#: One long request per compressed kind for the memory check: prefill chunks of
#: ``LONG_CHUNK`` then ``LONG_DECODES`` decodes.
LONG = {"csa": 2048, "hca": 2048}
LONG_CHUNK, LONG_DECODES = 128, 3
FP32_TOL = 1e-5
RUNNER_KW = dict(num_blocks=96, max_model_len=4096, max_num_batched_tokens=512)


def small_config(num_heads: int = 4, o_groups: int = 2) -> AttentionConfig:
    """The test model: one layer of each kind (sliding, CSA r=4, HCA r=128)."""
    return AttentionConfig(
        hidden_size=64, num_heads=num_heads, head_dim=80, rope_dim=16, q_lora_rank=32, o_groups=o_groups,
        o_lora_rank=24, window_size=8, index_num_heads=8, index_head_dim=32, index_topk=4,
        layer_kinds=("sliding", "csa", "hca"), compress_ratios=(1, 4, 128), max_position_embeddings=4096,
    )


def random_layer(config: AttentionConfig, layer_idx: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> DeepseekV4Attention:
    """A layer with deterministic weights of unit-scale activations: linear ~ N(0, 1/in), norm
    weights 1 + 0.1 N, position biases 0.5 N, sinks N(0, 1) (drawn on the CPU: the same on every
    rank and device)."""
    layer = DeepseekV4Attention(config, layer_idx)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            x = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                x = 1 + 0.1 * x
            elif name.endswith("position_bias"):
                x = 0.5 * x
            elif not name.endswith("sinks"):
                x = x / math.sqrt(p.shape[-1])
            p.copy_(x)
    return layer.to(device=device, dtype=dtype).eval()


def chunk_sizes(total: int, ratio: int, rng: random.Random) -> list[int]:
    """Chunk sizes summing to ``total``: 30% decodes (1), else 1..3r, cut on or next to every
    compression boundary."""
    sizes, s = [], 0
    while s < total:
        n = 1 if rng.random() < 0.3 else rng.randint(1, 3 * ratio)
        cut = (s // ratio + 1) * ratio + rng.choice([-1, 0, 1])
        if s + n > cut > s:
            n = cut - s
        n = min(n, total - s)
        sizes.append(n)
        s += n
    return sizes


def make_plan(lengths: dict[str, int], ratio: int, seed: int, max_active: int = 3) -> list[dict[str, int]]:
    """Steps of ``{request: tokens}``; at most ``max_active`` requests live, new ones admitted as
    others finish. The same on every rank (seeded)."""
    rng = random.Random(seed)
    plans = {k: chunk_sizes(n, ratio, rng) for k, n in lengths.items()}
    active: list[str]
    pending, active, steps = list(lengths), [], []
    while pending or active:
        while pending and len(active) < max_active:
            active.append(pending.pop(0))
        chosen = [k for k in active if rng.random() < 0.8] or active[:1]
        steps.append({k: plans[k].pop(0) for k in chosen})
        active = [k for k in active if plans[k]]
    return steps


def run_plan(runner: Any, seqs: dict[str, torch.Tensor], steps: list[dict[str, int]], free: bool = True,
             reserve: int = 0) -> dict[str, torch.Tensor]:
    """Feed ``seqs`` through ``runner`` step by step; a finished request is freed (``free``).
    ``reserve``: the first request first skips that many never-run tokens."""
    if reserve:
        reserve_context(runner, next(iter(seqs)), reserve)
    pos = {k: 0 for k in seqs}
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}
    for step in steps:
        chunks = {k: seqs[k][pos[k]:pos[k] + n] for k, n in step.items()}
        res = runner.step(chunks)
        for k, n in step.items():
            outs[k].append(res[k])
            pos[k] += n
            if free and pos[k] == seqs[k].shape[0]:
                runner.free(k)
    return {k: torch.cat(v).float() for k, v in outs.items()}


def reserve_context(runner: Any, request_id: str, num_tokens: int, chunk: int = RESERVE_CHUNK) -> None:
    """Start ``request_id`` at position ``num_tokens`` without running its first tokens (blocks
    allocated, pages as they are): ``DCPAttentionRunner.reserve``, or the same through the block
    manager of an ``AttentionRunner`` (in chunks, so sliding groups stay small; at most the
    engine's ``max_num_batched_tokens`` per chunk, what its sliding pools are sized for)."""
    if isinstance(runner, DCPAttentionRunner):
        runner.reserve(request_id, num_tokens, chunk)
        return
    chunk = min(chunk, runner.engine.max_num_batched_tokens)
    m = runner.manager
    m.add_request(request_id, 0)
    for end in [*range(chunk, num_tokens, chunk), num_tokens]:
        m.grow(request_id, end)
        m.advance(request_id, end)


def _rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[k].cpu() - want[k].cpu()).abs().max().item() for k in want) / scale


#: Caches whose size grows with the context (the SWA cache is bounded by the window).
CONTEXT_CACHES = ("compressed_kv", "indexer_k")


def held_bytes(runner: Any, request_id: str) -> dict[str, int]:
    """Bytes of each KV cache (SWA, compressed, indexer keys) a request holds on this rank:
    its blocks times the page size; for ``AttentionRunner`` and ``DCPAttentionRunner``."""
    if isinstance(runner, DCPAttentionRunner):
        held = runner.held_bytes(request_id)
        return {k: v for k, v in held.items() if k in ("swa_kv",) + CONTEXT_CACHES}
    c, m = runner.caches, runner.manager
    return {name: m.num_held(request_id, group) * t.stride(0) * t.element_size()
            for name, t, group in (("swa_kv", c.swa, "swa"), ("compressed_kv", c.compressed, "full_mla"),
                                   ("indexer_k", c.indexer_k, "full_mla")) if t is not None}


def parity_case(ctx: ParallelContext, kind: str, dtype: torch.dtype = torch.float32, impl: str | None = None,
                lengths: list[int] | None = None, seed: int = 0, num_heads: int = 4, o_groups: int = 2,
                memory: bool = False, reserve: int = 0, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """One kind through one plan: single process vs this rank's parallel runner (see module doc).
    ``kv_cache_dtype``: "auto" (pages in the layer dtype) or "fp8_ds_mla" (both runs quantise the
    same entries the same way, so the fp32 tolerance holds). ``reserve``: the first request starts
    at that position over zero-filled pages (never-run context, as the benchmarks use; the same
    zeros in both runs)."""
    dev = ctx.device
    impl = impl or ("auto" if dev.type == "cuda" else "reference")
    cfg = small_config(num_heads, o_groups)
    layer_idx = KINDS[kind]
    ratio = cfg.compress_ratios[layer_idx]
    lens = lengths or ([LONG[kind]] if memory else LENGTHS[kind])
    gen = torch.Generator().manual_seed(100 + seed)
    seqs32 = {f"r{i}": torch.randn(n, cfg.hidden_size, generator=gen).to(dev) for i, n in enumerate(lens)}
    if memory:
        n = lens[0] - LONG_DECODES
        steps = [{"r0": min(LONG_CHUNK, n - s)} for s in range(0, n, LONG_CHUNK)] + [{"r0": 1}] * LONG_DECODES
    else:
        steps = make_plan({k: v.shape[0] for k, v in seqs32.items()}, max(ratio, 4), seed)
    kw: dict[str, Any] = dict(RUNNER_KW, impl=impl, device=dev, kv_cache_dtype=kv_cache_dtype)
    layer32 = random_layer(cfg, layer_idx, seed, torch.float32, dev)
    single_runner = AttentionRunner(layer32, **kw)
    want = run_plan(single_runner, seqs32, steps, free=not memory, reserve=reserve)
    out: dict[str, Any] = {"kind": kind, "dtype": str(dtype).removeprefix("torch.")}
    if dtype == torch.float32:
        dist_runner = make_runner(layer32, ctx, **kw)
        got = run_plan(dist_runner, seqs32, steps, free=not memory, reserve=reserve)
        out["err"] = _rel_err(got, want)
        out["tol"] = FP32_TOL
    else:
        layer_lp = random_layer(cfg, layer_idx, seed, dtype, dev)
        seqs_lp = {k: v.to(dtype) for k, v in seqs32.items()}
        single = run_plan(AttentionRunner(layer_lp, **kw), seqs_lp, steps, reserve=reserve)
        dist_runner = make_runner(layer_lp, ctx, **kw)
        got = run_plan(dist_runner, seqs_lp, steps, free=not memory, reserve=reserve)
        out["err"] = _rel_err(got, want)
        out["single_err"] = _rel_err(single, want)
        out["tol"] = 2 * out["single_err"] + 1e-6
    out["ok"] = out["err"] <= out["tol"]
    if not memory:  # every request was freed: every block is back in its pool
        if isinstance(dist_runner, DCPAttentionRunner):
            back = all(v == kw["num_blocks"] for v in dist_runner.free_blocks.values())
        else:  # the engine sizes each group's pool by its geometry (a sliding layer's by the window)
            eng = dist_runner.engine
            back = all(eng.num_free_blocks(g) == n for g, n in eng.num_blocks.items())
        out["all_blocks_back"] = not dist_runner.requests and back
        out["ok"] = out["ok"] and out["all_blocks_back"]
    if memory:
        rid = next(iter(seqs32))
        single_held, mine = held_bytes(single_runner, rid), held_bytes(dist_runner, rid)
        out["single_bytes"] = {k: single_held[k] for k in CONTEXT_CACHES if k in single_held}
        out["rank_bytes"] = {k: mine[k] for k in CONTEXT_CACHES if k in mine}
        out["swa_bytes"] = (single_held["swa_kv"], mine["swa_kv"])
        c = dist_runner.caches
        pages = {"compressed_kv": c.compressed, "indexer_k": c.indexer_k}
        # the exact share, rounded up to whole blocks: at most one partial block per cache
        out["mem_ok"] = all(mine[k] <= single_held[k] / ctx.config.dcp + pages[k].stride(0) * pages[k].element_size()
                            for k in out["single_bytes"])
        out["ok"] = out["ok"] and out["mem_ok"]
    return out


def run_checks(ctx: ParallelContext, dtype: torch.dtype = torch.float32, kinds: tuple[str, ...] = tuple(KINDS),
               prefix: str | None = None, extra: dict[str, dict] | None = None) -> dict[str, dict[str, Any]]:
    """Parity of every kind (plus ``extra`` named ``parity_case`` keyword sets, and the memory
    check when DCP > 1); verdicts gathered over all ranks (``ok`` only if every rank's is)."""
    prefix = prefix or f"tp{ctx.config.tp}-dcp{ctx.config.dcp}"
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {tuple(KINDS)}, got {kinds}")
    cases: dict[str, dict[str, Any]] = {f"{prefix}-{k}": dict(kind=k, dtype=dtype) for k in kinds}
    if ctx.config.dcp > 1:
        cases |= {f"{prefix}-{k}-memory": dict(kind=k, dtype=dtype, memory=True) for k in LONG if k in kinds}
    cases |= {f"{prefix}-{k}": v for k, v in (extra or {}).items()}
    mine = {name: parity_case(ctx, **kw) for name, kw in cases.items()}
    if ctx.world_size == 1 or not dist.is_initialized():
        return mine
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    merged = {}
    for name in mine:
        per_rank = [r[name] for r in every]
        merged[name] = dict(per_rank[0], err=max(r["err"] for r in per_rank), ok=all(r["ok"] for r in per_rank))
        if "rank_bytes" in per_rank[0]:
            merged[name]["rank_bytes"] = [r["rank_bytes"] for r in per_rank]
    return merged


def format_results(results: dict[str, dict[str, Any]], ctx: ParallelContext) -> str:
    lines = [f"parity vs one process on {ctx.world_size} ranks ({ctx.device.type}), tp={ctx.config.tp} "
             f"dcp={ctx.config.dcp} interleave={ctx.config.dcp_interleave}"]
    for name, r in results.items():
        mem = ""
        if "single_bytes" in r:
            one, ranks = sum(r["single_bytes"].values()), [sum(b.values()) for b in r["rank_bytes"]]
            mem = f"  compressed-cache bytes held: one process {one}, per rank {ranks}"
        lines.append(f"  {name:28s} {r['dtype']:9s} err {r['err']:.2e} (tol {r['tol']:.1e}) "
                     f"{'ok' if r['ok'] else 'FAIL'}{mem}")
    return "\n".join(lines)


def spawn_worker(rank: int, world_size: int, init_method: str, backend: str, out_path: str,
                 dtype_names: tuple[str, ...] = ("float32",)) -> None:
    """Entry of the test processes (``torch.multiprocessing.spawn``): TP 2 (also over uneven
    output groups: 6 heads in 3 groups) and DCP 2 (interleave 1 and 2) over one 2-process group,
    for each dtype; rank 0 saves ``{case: result}`` (bf16 case names end in ``-bfloat16``)."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    from dsv4attn.distributed.launch import ParallelConfig, init_parallel

    tp = init_parallel(ParallelConfig(tp=world_size), rank=rank, world_size=world_size, local_rank=rank,
                       init_method=init_method, backend=backend, device=device)
    world = dist.group.WORLD
    dcp = ParallelContext(ParallelConfig(dcp=world_size), rank, world_size, device, 0, rank, None, world)
    dcp2i = ParallelContext(ParallelConfig(dcp=world_size, dcp_interleave=2), rank, world_size, device, 0, rank,
                           None, world)
    results: dict[str, Any] = {}
    for name in dtype_names:
        dtype = getattr(torch, name)
        uneven = {"sliding-6heads-3groups": dict(kind="sliding", dtype=dtype, num_heads=6, o_groups=3)}
        res = run_checks(tp, dtype, extra=uneven if world_size == 2 else None)
        extra = {f"{k}-reserved": dict(kind=k, dtype=dtype, reserve=700, lengths=[20, 9]) for k in ("csa", "hca")}
        extra |= {f"{k}-fp8": dict(kind=k, dtype=dtype, kv_cache_dtype="fp8_ds_mla") for k in ("csa", "hca")}
        res |= run_checks(dcp, dtype, extra=extra)
        res |= run_checks(dcp2i, dtype, kinds=("csa", "hca"), prefix="dcp-interleave2")
        results |= {k if name == "float32" else f"{k}-{name}": v for k, v in res.items()}
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
