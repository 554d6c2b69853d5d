"""Offline SASS census of the warp-specialised sm90 attention kernel, or of any sm_90 cubin (no GPU).

    python -m scripts.ws_sass                          # the bench's h64 prefill form (bf16 pages)
    python -m scripts.ws_sass --decode                 # the decode form (fp8 pages, two producers)
    python -m scripts.ws_sass --set DUAL=False,PIPE=True   # other constexprs of the kernel
    python -m scripts.ws_sass --cubin k.cubin          # another kernel (FlashMLA's, say: cuobjdump -xelf)

Compiles one variant of ``_sparse_mla_attn_sm90_ws_kernel`` for sm_90a with the installed Triton
(the prefill form: one indices-form set without lengths, max logits, pages of one row, whose
block size Triton makes a constant at launch; the decode form: an indices-form and a range-form
set with lengths), runs Triton's bundled ``ptxas -v`` (registers, spills) and ``nvdisasm``, and
prints each innermost loop of at least 20 instructions with its instruction count and commonest
opcodes, named by what it holds (the logits' 64 x 64 wgmma: a logits warpgroup, ours warpgroup 0,
both of FlashMLA's consumers; other wgmma only: a ``P V`` warpgroup; page copies or the
dequantisation: a producer). For a logits warpgroup it counts the **window** in which it gives the
tensor cores nothing: the instructions between the logits' ``WARPGROUP.DEPBAR`` and the next
``WARPGROUP.ARRIVE`` (its ``P V``), and those before the first branch inside (a path that skips
the rest). docs/benchmarks.md, Table 88, has the numbers of main's kernel and FlashMLA's.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from scripts.ncu_top import SASS_INSTR

_LABEL = re.compile(r"\s*\.?(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(\.?(L_x_\d+)\)")


@dataclass
class Loop:
    start: int  # instruction indices into the listing, inclusive
    end: int
    role: str
    ops: collections.Counter


def parse(sass: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """``nvdisasm -c`` text -> instructions (address, opcode, the rest of the line) and the
    index of the instruction each label names."""
    ins: list[tuple[int, str, str]] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = SASS_INSTR.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), (m.group(2) or "") + m.group(3) + m.group(4)))
    return ins, labels


def _role(ops: collections.Counter, text: str) -> str:
    if "HGMMA.64x64x16" in text:  # the logits: q [64, 512] x K [64, 512]^T in k-steps of 16
        return "logits warpgroup"
    if ops["HGMMA"]:
        return "P V warpgroup"
    if ops["LDGSTS"] or ops["HMUL2"] or ops["STAS"]:
        return "producer"
    return "other"


def loops(ins: list[tuple[int, str, str]], labels: dict[str, int], min_len: int = 20) -> list[Loop]:
    """The innermost loops (a predicated branch back to a label) of at least ``min_len``
    instructions. The out-of-line retry blocks of barrier waits end in an unconditional branch
    back into their loop, which is no loop of its own."""
    found = []
    for i, (_, op, text) in enumerate(ins):
        m = _BRANCH.search(text) if op == "BRA" and text.startswith("@") else None
        if m and m.group(1) in labels and labels[m.group(1)] <= i and i - labels[m.group(1)] + 1 >= min_len:
            found.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in found if not any((a, b) != (c, d) and a <= c and d <= b for c, d in found)]
    out = []
    for a, b in sorted(set(inner)):
        ops = collections.Counter(op for _, op, _ in ins[a:b + 1])
        out.append(Loop(a, b, _role(ops, "\n".join(t for _, _, t in ins[a:b + 1])), ops))
    return out


def window(ins: list[tuple[int, str, str]], loop: Loop) -> dict | None:
    """A logits warpgroup's tensor-idle window in ``loop``: instructions from the logits' completion
    (the ``WARPGROUP.DEPBAR`` after the last 64 x 64 wgmma) to the next ``WARPGROUP.ARRIVE``, the
    part before the first branch in it, and its partition barriers."""
    body = range(loop.start, loop.end + 1)
    last_s = max((i for i in body if "HGMMA.64x64x16" in ins[i][2]), default=None)
    if last_s is None:
        return None
    dep = next((i for i in range(last_s, loop.end + 1) if ins[i][1] == "WARPGROUP" and "DEPBAR" in ins[i][2]), None)
    arr = next((i for i in range(dep or last_s, loop.end + 1) if ins[i][1] == "WARPGROUP" and "ARRIVE" in ins[i][2]), None)
    if dep is None or arr is None:
        return None
    branch = next((i for i in range(dep, arr) if ins[i][1] == "BRA"), None)
    return dict(instructions=arr - dep - 1, to_first_branch=None if branch is None else branch - dep - 1,
                barriers=sum(ins[i][1] == "BAR" for i in range(dep, arr)))


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def compile_variant(changes: dict, decode: bool):
    """The ws kernel's prefill or decode form with ``changes``, compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget

    from dsv4attn.kernels import sparse_attn_sm90_ws as ws
    from scripts.compile_check import sm90_source

    if decode:
        const = dict(A_RANGE=False, HAS_B=True, B_RANGE=True, HAS_SINK=True, WRITE_PARTIAL=False, OUT_BF16=True,
                     A_LEN=True, B_LEN=True, WRITE_MAX=False, PAGES_BF16=False, DUAL=True)
        ones: tuple[str, ...] = ()
    else:
        const = dict(A_RANGE=False, HAS_B=False, B_RANGE=False, HAS_SINK=True, WRITE_PARTIAL=False, OUT_BF16=True,
                     A_LEN=False, B_LEN=False, WRITE_MAX=True, PAGES_BF16=True)
        ones = ("a_block_size",)
    const.update(changes)
    kernel = ws._sparse_mla_attn_sm90_ws_kernel
    return triton.compile(sm90_source(kernel, const, const["PAGES_BF16"], ones), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=ws.NUM_WARPS, num_stages=1))


def report(sass: str) -> list[str]:
    ins, labels = parse(sass)
    lines = []
    for lp in loops(ins, labels):
        top = ", ".join(f"{k} {v}" for k, v in lp.ops.most_common(8))
        lines.append(f"{lp.role}: {lp.end - lp.start + 1} instructions per iteration ({top})")
        w = window(ins, lp) if lp.role == "logits warpgroup" else None
        if w:
            lines.append(f"  window (logits done -> P V issued): {w['instructions']} instructions"
                         + (f", {w['to_first_branch']} to the first branch" if w["to_first_branch"] is not None else "")
                         + f", {w['barriers']} partition barriers")
    return lines


def _value(text: str) -> bool | int:
    if text in ("True", "False"):
        return text == "True"
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", action="store_true", help="the decode form (fp8 pages) instead of prefill")
    ap.add_argument("--set", default="", help="constexprs to change, NAME=VALUE,... (True / False / ints)")
    ap.add_argument("--cubin", default="", help="report on this sm_90 cubin instead of compiling")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = a.cubin
        if not cubin:
            from scripts.sm90_report import ptxas_usage

            changes = {k.strip(): _value(v.strip()) for k, _, v in (x.partition("=") for x in a.set.split(",") if x)}
            ck = compile_variant(changes, a.decode)
            regs, spills = ptxas_usage(ck.asm["ptx"], ck.metadata.name)
            print(f"ptxas: {regs} registers, {spills} bytes of spill stores per thread")
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(ck.asm["cubin"])
        sass = subprocess.run([_bin("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    print("\n".join(report(sass)))


if __name__ == "__main__":
    main()
