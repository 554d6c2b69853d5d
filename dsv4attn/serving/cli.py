"""``python -m dsv4attn generate``: serve a DeepSeek-V4 model over the paged backend (the main job).

    python -m dsv4attn generate --tiny 0 --check           # `make demo`
    python -m dsv4attn generate --model DIR --prompts p.json --max-new-tokens 64 --json
    torchrun --nproc-per-node 2 -m dsv4attn generate --tiny 0 --tp 2 --check   # or --dcp 2 (docs/distributed.md)

``--tiny SEED`` builds a small random DeepSeek-V4 with transformers (every layer kind, MoE,
hyper-connections); ``--model DIR`` loads a local checkpoint. Prompts: ``--prompts FILE`` (a
JSON list of lists of token ids) or random ones whose lengths sit on and around the compression
boundaries. Prints progress, tokens/s and, with ``--check``, a verdict against transformers'
own greedy ``generate`` (one prompt at a time, eager attention):

- float32 with ``--kv-cache-dtype auto``: every generated token must be identical.
- bfloat16 or fp8 caches: free-running greedy sequences may legitimately part where two logits
  are closer than the rounding error, so the verdict is teacher-forced: both models read the
  oracle's sequence, and ours must stay within ``LOWP_FACTOR`` x the reference's own error (the
  same-dtype transformers run against its float32 copy) of the float32 logits. First-divergence
  statistics of the free-running sequences are printed for information.

Exit status 1 on FAIL. ``--json`` makes the last stdout line the JSON list of generated tokens.
Other jobs: ``layer-demo`` (a three-kind layer stack vs transformers), ``metadata-demo``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

#: Low-precision bound: our logits' error vs float32 may be this many times the reference's own
#: low-precision error. bf16 caches: we round at the same points as transformers or fewer (the
#: attention math is fp32), measured 0.8x on the tiny model; 2x leaves room for other rounding
#: points. fp8_ds_mla caches add e4m3 rounding (2^-4 relative) of the NoPE dims of each cached
#: entry, averaged over the attended entries: measured 1.03x; bound 4x.
LOWP_FACTOR = {"auto": 2.0, "fp8_ds_mla": 4.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4attn", description="DeepSeek-V4 sparse attention backend: jobs")
    sub = p.add_subparsers(dest="job", required=True)
    g = sub.add_parser("generate", help="greedy generation of a whole model over the paged backend",
                       description=__doc__.split("\n\n")[1])
    src = g.add_mutually_exclusive_group()
    src.add_argument("--tiny", type=int, metavar="SEED", help="a small random DeepSeek-V4 (default: --tiny 0)")
    src.add_argument("--model", metavar="DIR", help="a local transformers DeepSeek-V4 checkpoint")
    g.add_argument("--prompts", metavar="FILE", help="JSON list of lists of token ids (default: random)")
    g.add_argument("--num-prompts", type=int, default=8, help="random prompts to make (default 8)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8_ds_mla", "fp8"), default="auto")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    g.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + new tokens")
    g.add_argument("--token-budget", type=int, default=256, help="tokens per step (default 256)")
    g.add_argument("--chunk-size", type=int, default=None, help="largest prompt chunk per step")
    g.add_argument("--max-num-reqs", type=int, default=16, help="requests served at once")
    g.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: verify up to K prompt-lookup drafts per request and step (0..7; "
                        "same greedy output; prints the acceptance rate)")
    g.add_argument("--max-cached-prefixes", type=int, default=0, metavar="N",
                   help="prefix caching: keep up to N prompt prefixes (multiples of 256 tokens) in the caches for "
                        "later prompts that start with them (default 0: off; prints hits)")
    g.add_argument("--check", action="store_true", help="compare with transformers; exit 1 on mismatch")
    g.add_argument("--json", action="store_true", help="last stdout line: JSON list of generated token lists")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--no-progress", action="store_true")
    from dsv4attn.distributed.launch import add_parallel_args  # --tp / --dcp / --dcp-interleave (torchrun)

    add_parallel_args(g)
    sub.add_parser("layer-demo", help="three layer kinds serving a workload, checked against transformers",
                   add_help=False)
    sub.add_parser("metadata-demo", help="one mixed step through every metadata builder")
    return p


def _progress(total: int, enabled: bool, label: str):
    """``bar(n)`` / ``bar.close()``: tqdm on stderr when installed, else a plain counter line."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="tok", desc=label, leave=False, file=sys.stderr)
    except ImportError:
        return _LineBar(total, label)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _LineBar(_NoBar):
    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\r{self.label}: {self.done}/{self.total} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


#: Prompt lengths on and next to the 4/128 compression boundaries (the CLI's random prompts).
BOUNDARY_LENGTHS = (1, 3, 4, 5, 63, 127, 128, 129, 200, 257)


def random_prompts(n: int, vocab: int, seed: int, lengths: Sequence[int] = BOUNDARY_LENGTHS) -> list[list[int]]:
    """``n`` random prompts (token ids in ``[0, vocab)``) whose lengths cycle through ``lengths``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def load_model(args, device, dtype):
    import torch

    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="eager")
        return model.to(device).eval(), f"{args.model}"
    from dsv4attn.serving.tiny import tiny_hf_model

    seed = 0 if args.tiny is None else args.tiny
    model = tiny_hf_model(seed, dtype=torch.float32).to(device=device, dtype=dtype)
    return model, f"tiny DeepSeek-V4 (seed {seed})"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def teacher_forced_errors(pm, hf_model, prompts, refs, reference: bool = True) -> tuple[float, float] | None:
    """Max |logit - float32 logit| over the generated positions: (ours, reference same dtype).
    ``reference=False`` (ranks other than 0 of a parallel run) only runs our steps: None."""
    import copy

    import torch

    ours_all = []
    for i, (p, o) in enumerate(zip(prompts, refs)):
        seq = list(p) + list(o[:-1])
        pm.begin_step({("check", i): seq})
        ours_all.append(pm.forward_step(all_tokens=True))
        pm.end_step()
        pm.free(("check", i))
    if not reference:
        return None
    hf32 = copy.deepcopy(hf_model).float()
    ours_err = ref_err = 0.0
    for p, o, ours in zip(prompts, refs, ours_all):
        seq = list(p) + list(o[:-1])
        ids = torch.tensor([seq], device=pm.device)
        with torch.no_grad():
            lowp = hf_model(ids).logits[0].float()
            gold = hf32(ids).logits[0].float()
        sl = slice(len(p) - 1, len(seq))
        ours_err = max(ours_err, (ours[sl] - gold[sl]).abs().max().item())
        ref_err = max(ref_err, (lowp[sl] - gold[sl]).abs().max().item())
    return ours_err, ref_err


def generate_main(args) -> int:
    """One process, or one rank of ``torchrun --nproc-per-node N ... --tp T --dcp D`` (N = T x D):
    every rank serves the same prompts; only rank 0 prints and checks against transformers."""
    import contextlib
    import io
    import os

    import torch
    import torch.distributed as dist

    from dsv4attn.distributed.launch import init_parallel, parallel_config_from_args

    device = args.device
    if device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    owns_group = not dist.is_initialized()
    try:
        ctx = init_parallel(parallel_config_from_args(args), device=device)
    except ValueError as e:
        raise SystemExit(f"dsv4attn generate: {e}") from None
    try:
        if ctx.rank == 0:
            return _generate(args, ctx)
        with contextlib.redirect_stdout(io.StringIO()):
            _generate(args, ctx)
        return 0
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _generate(args, ctx) -> int:
    import torch

    from dsv4attn.distributed.model import paged_model
    from dsv4attn.serving.model import reference_generate

    lead = ctx.rank == 0
    device = ctx.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    kv = "fp8_ds_mla" if args.kv_cache_dtype == "fp8" else args.kv_cache_dtype
    model, name = load_model(args, device, dtype)
    vocab = model.config.vocab_size
    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
    else:
        prompts = random_prompts(args.num_prompts, vocab, args.seed)
    n_new = args.max_new_tokens
    max_len = args.max_model_len or max(len(p) for p in prompts) + n_new
    pm = paged_model(model, ctx, kv_cache_dtype=kv, max_model_len=max_len, device=device,
                     max_num_batched_tokens=args.token_budget, max_num_reqs=args.max_num_reqs,
                     num_speculative_tokens=args.num_speculative_tokens,
                     max_cached_prefixes=args.max_cached_prefixes)
    par = f", {ctx.world_size} processes (tp {ctx.config.tp} x dcp {ctx.config.dcp})" if ctx.world_size > 1 else ""
    print(f"model: {name}, {len(pm.layers)} layers {[layer.kind for layer in pm.layers]}, {dtype}, "
          f"kv cache {kv}, device {device}{par}")
    print(f"workload: {len(prompts)} prompts (lengths {min(map(len, prompts))}..{max(map(len, prompts))}), "
          f"{n_new} new tokens each, token budget {args.token_budget}/step")
    total = sum(len(p) for p in prompts) + len(prompts) * max(n_new - 1, 0)
    bar = _progress(total, not args.no_progress and lead, "generate")
    t0 = time.perf_counter()
    k = args.num_speculative_tokens
    outs = pm.generate(prompts, n_new, chunk_size=args.chunk_size, progress=bar.update, num_speculative_tokens=k,
                       return_stats=k > 0)
    outs, spec_stats = outs if k > 0 else (outs, None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    bar.close()
    gen = sum(len(o) for o in outs)
    print(f"generated {gen} tokens in {dt:.2f} s: {gen / dt:.1f} new tokens/s, {total / dt:.1f} tokens/s processed")
    if spec_stats is not None:
        print(spec_stats.summary())
    cache = getattr(pm, "prefix_cache", None)
    if cache is not None:
        st = cache.stats
        print(f"prefix cache: {st.hits} of {st.lookups} prompts started from a cached prefix, {st.hit_tokens} prompt "
              f"tokens not computed; {len(cache)} prefixes held ({st.saved} saved, {st.evicted} given back)")
    ok = True
    if args.check:
        refs = None
        if lead:  # the oracle runs on rank 0 only
            bar = _progress(total, not args.no_progress, "transformers")
            t0 = time.perf_counter()
            refs = reference_generate(model, prompts, n_new, progress=bar.update)
            bar.close()
            print(f"transformers generate (eager, one prompt at a time): {time.perf_counter() - t0:.2f} s")
        exact = dtype == torch.float32 and kv == "auto"
        if not exact and ctx.world_size > 1:  # every rank runs the teacher-forced steps: share the sequences
            import torch.distributed as dist

            box = [refs]
            dist.broadcast_object_list(box, src=0)
            refs = box[0]
        if not lead:
            if not exact:
                teacher_forced_errors(pm, model, prompts, refs, reference=False)
            return 0
        assert refs is not None  # the lead ran the oracle above
        div = [first_divergence(a, b) for a, b in zip(outs, refs)]
        same = sum(d is None for d in div)
        print(f"identical sequences: {same}/{len(prompts)}; first divergence at "
              f"{[d for d in div if d is not None] or 'none'}")
        if exact:
            ok = same == len(prompts)
            print(f"check (float32, exact): every generated token equal -> {'PASS' if ok else 'FAIL'}")
        else:
            errs = teacher_forced_errors(pm, model, prompts, refs)
            assert errs is not None  # reference=True returns (ours, reference)
            ours, ref = errs
            bound = LOWP_FACTOR[kv] * ref
            ok = ours <= bound
            print(f"check ({dtype}, {kv}, teacher-forced): max |logit - fp32 logit| ours {ours:.3e} vs bound "
                  f"{LOWP_FACTOR[kv]:g} x reference's own {ref:.3e} = {bound:.3e} -> {'PASS' if ok else 'FAIL'}")
        print("PASS" if ok else "FAIL")
    if args.json:
        print(json.dumps(outs))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = build_parser().parse_known_args(argv)
    if args.job == "layer-demo":
        from dsv4attn.serving import layer_demo

        layer_demo.main(rest)
        return 0
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    if args.job == "metadata-demo":
        from dsv4attn.serving import metadata_demo

        metadata_demo.run()
        return 0
    return generate_main(args)
