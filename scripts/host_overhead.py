"""Host cost of one eager call of the three sparse attention entry points (issue 9).

Production decode shapes: B = 64 tokens, h = 64 heads, head_dim 512, fp8_ds_mla pages of block
size 64, 512 top-k candidates + 128 SWA candidates in a second cache (indices form), sink.
``flash_mla_sparse_fwd`` runs 64 tokens over a bf16 kv of 32768 rows, top-k 512.

* CPU (default without CUDA, or ``--stub``): the Triton kernels are replaced by no-op stand-ins
  (``kernel[grid](...)`` returns at once a stand-in compiled kernel: a no-op launcher, a
  function handle and packed metadata, as Triton's has), so the time is our Python path only:
  validation, config choice, allocation and argument assembly, without Triton's own launcher.
  Off a GPU the launch cache leaves CPU tensors alone, so these calls are not planned.
* CPU with ``--planned``: the same, but dispatch takes the sm90 kernels (stand-ins too) and the
  launch cache serves CPU tensors, so calls are planned as on Hopper: the four modes below then
  time this library's own Python of a planned call (plans direct: the stand-in launcher called
  as a plan calls Triton's).
* GPU (``--device cuda``, no ``--stub``): wall time per eager call of the real path (Triton's
  launcher included) with the device synchronised once before and once after the timed loop,
  i.e. no sync inside it; with ``--calls`` large enough the queue fills, so this is the host
  time only while the host is slower than the kernels (small batches). Each entry point is
  timed four ways: call plans (:mod:`dsv4attn.ops.call_plan`) and the launch cache
  (:mod:`dsv4attn.ops.launch_cache`) on, with the plans calling Triton's launcher directly
  (``call_plan.DIRECT = True``, the default) or through its runner closure; the launch cache
  alone; neither.

Prints one line per entry point: median and minimum over ``--repeats`` loops of ``--calls``
calls each (the minimum is the figure to compare on a loaded machine).

    PYTHONPATH=. python -m scripts.host_overhead            # CPU, stubbed kernels
    PYTHONPATH=. python -m scripts.host_overhead --planned  # CPU, planned calls on stand-ins
    python3 -m scripts.host_overhead --device cuda          # H200, real launches
    python -m scripts.host_overhead --profile flash_mla_with_kvcache   # cProfile top entries
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch

from benchmarks.common import back_to_back_us

BATCH, HEADS, D, BLOCK, TOPK, SWA, ENTRY_BYTES = 64, 64, 512, 64, 512, 128, 584


def _no_op(*args, **kwargs) -> None:
    return None


class _NoLaunchCompiled:
    """Stands in for Triton's compiled kernel: ``[grid]`` gives a no-op runner, ``run`` is a
    no-op launcher, and it has the function handle and packed metadata a plan passes that."""

    function = packed_metadata = object()
    run = staticmethod(_no_op)

    def __getitem__(self, grid):
        return _no_op


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel (``real``'s parameters, which the launch cache
    reads): ``kernel[grid](...)`` launches nothing and returns a :class:`_NoLaunchCompiled`."""

    def __init__(self, real) -> None:
        self.fn = real.fn

    def __getitem__(self, grid):
        return self._call

    @staticmethod
    def _call(*args, **kwargs) -> _NoLaunchCompiled:
        return _NoLaunchCompiled()


def stub_kernels(planned: bool = False) -> None:
    """Replace the attention kernels by :class:`_NoLaunch` (host-only timing). Off a GPU the
    launch cache takes Triton's usual path, so calls are not planned; with ``planned``
    (``--planned``) dispatch takes the sm90 kernels (stand-ins too), the launch cache serves CPU
    tensors and plans launch on a stand-in stream, so calls are planned as on Hopper."""
    from dsv4attn.ops import call_plan, launch_cache
    from dsv4attn.testing.stand_ins import replace_attention_kernels

    replace_attention_kernels(_NoLaunch, sm90=planned, compiled=_NoLaunchCompiled)
    if not planned:
        return
    launch_cache.DEVICE_TYPES = ("cpu", "cuda")
    launch_cache.current_device = lambda: 0
    call_plan._stream_source = lambda: ((lambda device: 0), 0)


def build_calls(device: torch.device) -> dict:
    """The three entry points as zero-argument callables on the production shapes."""
    import dsv4attn
    from dsv4attn.ops.candidate_set import CandidateSet

    gen = torch.Generator(device="cpu").manual_seed(0)

    def slots(k: int, blocks: int) -> torch.Tensor:
        return torch.randperm(blocks * BLOCK, generator=gen)[: BATCH * k].to(torch.int32).view(BATCH, 1, k).to(device)

    blocks, eblocks = BATCH * TOPK // BLOCK, BATCH * SWA // BLOCK
    # Zero bytes decode to finite values (scale 2^-127); the content does not change the time.
    main = torch.zeros(blocks, BLOCK, ENTRY_BYTES, dtype=torch.uint8, device=device)
    extra = torch.zeros(eblocks, BLOCK, ENTRY_BYTES, dtype=torch.uint8, device=device)
    idx, eidx = slots(TOPK, blocks), slots(SWA, eblocks)
    q = (torch.randn(BATCH, 1, HEADS, D, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sink = torch.randn(HEADS, generator=gen).to(device)
    meta, _ = dsv4attn.get_mla_metadata()
    impl = "triton"

    def with_kvcache():
        return dsv4attn.flash_mla_with_kvcache(q, main.unsqueeze(-2), None, None, D, meta, softmax_scale=D**-0.5,
                                               is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                                               extra_k_cache=extra.unsqueeze(-2), extra_indices_in_kvcache=eidx,
                                               impl=impl)

    full = dict(dtype=torch.int32, device=device)
    sets = [CandidateSet(cache=main, lengths=torch.full((BATCH,), TOPK, **full), indices=idx[:, 0]),
            CandidateSet(cache=extra, lengths=torch.full((BATCH,), SWA, **full), indices=eidx[:, 0])]
    q3 = q[:, 0]

    def op():
        return dsv4attn.sparse_mla_attention(q3, sets, D**-0.5, sink, impl=impl)

    kv = torch.zeros(BATCH * TOPK, 1, D, dtype=torch.bfloat16, device=device)
    pidx = slots(TOPK, blocks)

    def sparse_fwd():
        return dsv4attn.flash_mla_sparse_fwd(q3, kv, pidx, D**-0.5, attn_sink=sink, impl=impl)

    return {"flash_mla_with_kvcache": with_kvcache, "flash_mla_sparse_fwd": sparse_fwd,
            "sparse_mla_attention": op}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stub", action="store_true", help="no-op kernels (implied on CPU)")
    ap.add_argument("--planned", action="store_true", help="CPU: no-op compiled kernels, so calls are planned")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", default=None, help="cProfile one entry point and print the top 25")
    args = ap.parse_args()
    device = torch.device(args.device)
    stub = args.stub or device.type == "cpu"
    if device.type == "cpu":
        # impl="triton" on CPU needs Triton's interpreter flag; the stub keeps it from running.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    planned = args.planned and device.type == "cpu"
    if stub or planned:
        stub_kernels(planned)
    calls = build_calls(device)
    mode = ("stand-in compiled kernels, planned (host Python only)" if planned else
            "stubbed kernels (host Python only)" if stub else "real launches, no sync in the loop")
    print(f"device {device}, {mode}; B{BATCH} h{HEADS} {TOPK}+{SWA} candidates, fp8 pages", flush=True)
    if args.profile:
        fn = calls[args.profile]
        for _ in range(10):
            fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    from dsv4attn.ops import call_plan, launch_cache

    defaults = launch_cache.ENABLED, call_plan.ENABLED, call_plan.DIRECT
    # plans launching through Triton's launcher | plans through its runner (the default) | the
    # launch cache alone | neither (Triton binds every launch)
    modes = [("plans direct", True, True, True), ("plans runner", True, True, False),
             ("plans off   ", True, False, True), ("cache off   ", False, False, True)]
    for name, fn in calls.items():
        # CPU with stubs: no plan or cache
        for tag, cached, plans, direct in modes if device.type == "cuda" or planned else modes[2:3]:
            launch_cache.ENABLED, call_plan.ENABLED, call_plan.DIRECT = cached, plans, direct
            med, best = back_to_back_us(fn, args.calls, args.repeats, device_time=False)
            print(f"{name:24s}  {tag}  median {med:8.1f} us/call   min {best:8.1f} us/call", flush=True)
    launch_cache.ENABLED, call_plan.ENABLED, call_plan.DIRECT = defaults
    if planned or device.type == "cuda":  # whether the "plans" rows timed planned calls at all
        print(f"plans kept: {sum(isinstance(v, call_plan.CallPlan) for v in call_plan._plans.values())} of the op, "
              f"{sum(isinstance(v, tuple) for v in call_plan._plans.values())} of FlashMLA's entry points")


if __name__ == "__main__":
    main()
