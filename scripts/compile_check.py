"""Compile every Triton kernel specialisation the CPU tests launch, for real GPU targets, without a GPU.

Step 1 (``record``): run pytest on CPU under Triton's interpreter with a hook on kernel launches
and write, per distinct specialisation, the kernel's module and name, its argument types
(pointer dtypes, int widths, 16-divisibility of ints and pointers as Triton would specialise
them), its constexprs and launch options, to a JSON file.
Step 2 (``compile``): in a process without the interpreter, compile each recorded specialisation
(and the GPU-only forms derived from it: :func:`gpu_only_variants`) with ``triton.compile`` for
the given targets (default sm_80 and sm_90) and report failures: what a GPU with another
architecture or another Triton release would hit on first use.

    python3 -m scripts.compile_check record specs.json tests/test_sparse_attn.py ...
    python3 -m scripts.compile_check compile specs.json [--targets 80,90] [--sm90]

The Gluon sm90 kernels are not launched on CPU, so step 2 also compiles their variants (page kind x
set forms x partial output, for both kernels) for sm_90 directly from their
signatures (``compile --sm90``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def record(out_path: str, pytest_args: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the tests' CPU path (on a GPU machine too)
    import pytest

    from dsv4attn.testing.triton_specs import recording

    with recording() as found:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", "-x", *pytest_args])
    specs: dict[str, dict] = {}
    for s in found.values():  # what compile_all needs: one entry per compiled binary
        s = dict(s, options={k: s["options"][k] for k in ("num_warps", "num_stages") if k in s["options"]})
        del s["ones"]
        specs.setdefault(json.dumps(s, sort_keys=True, default=str), s)
    with open(out_path, "w") as f:
        json.dump(list(specs.values()), f, indent=0, default=str)
    print(f"recorded {len(specs)} specialisations (pytest rc {rc})")
    if rc != 0 or not specs:
        sys.exit(f"recording failed: pytest rc {rc}, {len(specs)} specialisations")


def gpu_only_variants(spec: dict) -> list[dict]:
    """Specialisations a GPU launches that the interpreter never records, derived from a recorded
    one: the indexer's word-loaded fp8 keys with bf16 dots (128 keys per dot) and the inline-PTX
    decode (the interpreter scores in fp32 and cannot run PTX)."""
    const = dict(spec["constexprs"])
    if spec["name"] != "_indexer_topk_kernel" or not const.get("WORDS"):
        return []
    const.update(DOT_BF16=True, ASM=True, BLOCK_N=min(128, const["K_P2"]))
    return [dict(spec, constexprs=const, signature=dict(spec["signature"], q_ptr="*bf16"))]


def compile_all(path: str, targets: list[int]) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # The library's kernels only (a test may define a helper kernel of its own).
    specs = [s for s in json.load(open(path)) if s["module"].startswith("dsv4attn.")]
    specs += [v for s in specs for v in gpu_only_variants(s)]
    failures = 0  # an empty record is refused where it is made (record exits non-zero)
    for cc in targets:
        ok = 0
        for s in specs:
            kernel = getattr(importlib.import_module(s["module"]), s["name"])
            names = list(kernel.arg_names)
            const = dict(s["constexprs"])
            if "CPU_INTERP" in const:
                const["CPU_INTERP"] = False  # recorded under the interpreter; GPUs take the native path
            constexprs = {(names.index(n),): v for n, v in const.items()}
            attrs = {(i,): [["tt.divisibility", 16]] for i in s["divisible"]}
            src = ASTSource(kernel, s["signature"], constexprs, attrs)
            try:
                triton.compile(src, target=GPUTarget("cuda", cc, 32), options=s["options"])
                ok += 1
            except Exception as e:  # noqa: BLE001 - report every failure
                failures += 1
                print(f"FAIL sm_{cc} {s['module']}.{s['name']} {s['constexprs']}: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1][:300]}")
        print(f"sm_{cc}: {ok}/{len(specs)} specialisations compile with Triton {triton.__version__}")
    return failures


def sm90_source(kernel, const: dict, bf16: bool, ones: tuple[str, ...] = ()):
    """The compile source of one variant of a Gluon sm90 attention kernel: ``const`` its
    constexprs (every other one at its default, as a launch that omits it; ``const`` is
    completed in place), bf16 or fp8 pages, and the integer arguments in ``ones`` equal to 1
    (Triton makes them constants at launch, e.g. the block size of pages of one row)."""
    import inspect

    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(kernel.arg_names)
    for i in kernel.constexprs:
        default = inspect.signature(kernel.fn).parameters[names[i]].default
        if names[i] not in const and default is not inspect.Parameter.empty:
            const[names[i]] = default
    spec = dict(const, **{a: 1 for a in ones})
    sig = {}
    for a in names:
        if a in spec:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            if "cache" in a:
                sig[a] = "*bf16" if bf16 else "*u8"
            elif a in ("q_ptr", "out_ptr"):
                sig[a] = "*bf16"
            elif any(x in a for x in ("idx", "len", "bt", "req", "start")):
                sig[a] = "*i32"
            else:
                sig[a] = "*fp32"
        else:
            sig[a] = "fp32" if a == "qk_scale" else "i32"
    # What Triton's specialisation proves at launch for production caches: 16-aligned pointers,
    # block / entry / row strides that are multiples of 16 (uses_sm90 requires it).
    div = [i for i, a in enumerate(names) if a not in spec and (a.endswith("_ptr") or a in (
        "a_stride_blk", "b_stride_blk", "a_stride_entry", "b_stride_entry", "stride_q_t", "stride_q_h",
        "stride_o_t", "stride_o_h"))]
    return GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in spec.items()},
                          {(i,): [["tt.divisibility", 16]] for i in div})


def compile_sm90() -> int:
    """Compile the Gluon sm90 kernels' variants for sm_90a (what dispatch can launch): the
    single-partition kernel and the warp-specialised one (page kind x set forms x partial
    output, and on fp8 pages the producers: plain or loads ahead, the merged sets and the two
    producer warpgroups, each but the merged sets also as the two-CTA cluster; the cluster's K-stage offset is checked
    against what its inline PTX assumes), and the q-in-registers kernel of bf16 pages (its
    copies by rows or by columns)."""
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget

    from dsv4attn.kernels import sparse_attn_sm90, sparse_attn_sm90_qreg, sparse_attn_sm90_ws

    failures = n = 0
    kernels = ((sparse_attn_sm90._sparse_mla_attn_sm90_kernel, sparse_attn_sm90.NUM_WARPS, (False, True)),
               (sparse_attn_sm90_ws._sparse_mla_attn_sm90_ws_kernel, sparse_attn_sm90_ws.NUM_WARPS, (False, True)),
               (sparse_attn_sm90_qreg._sparse_mla_attn_sm90_qreg_kernel, sparse_attn_sm90_qreg.NUM_WARPS, (True,)))
    for kernel, warps, page_kinds in kernels:
        names = list(kernel.arg_names)
        pipes = (False, True) if "PIPE" in names else (False,)
        clusters = (False, True) if "CLUSTER" in names else (False,)
        merges = (False, True) if "MERGE" in names else (False,)
        duals = (False, True) if "DUAL" in names else (False,)
        col_copies = (False, True) if "COL_COPIES" in names else (False,)
        for bf16, a_range, b_range, partial, pipe, cluster, merge, dual, cols in itertools.product(
                page_kinds, (False, True), (False, True), (False, True), pipes, clusters, merges, duals, col_copies):
            if (pipe or cluster) and bf16:  # fp8 producers' variants only
                continue
            if merge and (not pipe or cluster or a_range != b_range):  # what the launcher can pick
                continue
            if dual and (bf16 or pipe):  # two producer warpgroups: fp8 pages, loads not ahead
                continue
            const = dict(A_RANGE=a_range, HAS_B=True, B_RANGE=b_range, HAS_SINK=True, WRITE_PARTIAL=partial,
                         OUT_BF16=True, A_LEN=True, B_LEN=True, WRITE_MAX=not partial)
            const.update({k: v for k, v in (("PAGES_BF16", bf16), ("PREFETCH", True), ("SKIP", 0), ("PIPE", pipe),
                                            ("CLUSTER", cluster), ("MERGE", merge), ("DUAL", dual), ("COL_COPIES", cols))
                          if k in names})
            src = sm90_source(kernel, const, bf16)
            n += 1
            try:
                ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
                if cluster:  # where the launcher will find the K stages (its inline PTX assumes K_OFF there)
                    from dsv4attn.ops.sparse_attn_launch import _k_stage_offset

                    off = _k_stage_offset(ck.asm["ttgir"])
                    if off != const["K_OFF"]:
                        raise RuntimeError(f"K stages at offset {off}, not {const['K_OFF']}: the launcher recompiles")
            except Exception as e:  # noqa: BLE001 - report every failure
                failures += 1
                print(f"FAIL {kernel.__name__} {const}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
    print(f"sm_90: {n - failures}/{n} variants of the Gluon sm90 kernels compile with Triton {triton.__version__}")
    return failures


def main() -> None:
    mode = sys.argv[1]
    if mode == "record":
        record(sys.argv[2], sys.argv[3:])
    elif mode == "compile":
        targets = [80, 90]
        if "--targets" in sys.argv:
            targets = [int(x) for x in sys.argv[sys.argv.index("--targets") + 1].split(",")]
        failures = compile_all(sys.argv[2], targets)
        if "--sm90" in sys.argv:
            failures += compile_sm90()
        sys.exit(1 if failures else 0)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
