"""Top SASS lines, or source lines, by warp-stall samples from ``ncu --page source --print-source sass --csv``.

    python3 -m scripts.ncu_top source.csv [N]                  # top N SASS instructions
    python3 -m scripts.ncu_top source.csv [N] --sass k.sass    # top N source lines, with stall reasons

``k.sass``: ``nvdisasm -g -c`` of the profiled kernel's cubin (Triton keeps it in its cache as
``<kernel>.cubin``); its ``//## File ..., line ...`` comments map each instruction offset to a
source line. ncu prints absolute addresses: offsets are taken from the first instruction, and
the opcodes are checked against the disassembly (a different cubin is refused).
"""

from __future__ import annotations

import collections
import csv
import re
import sys


#: One instruction line of ``nvdisasm -c`` output: offset, predicate, opcode, the rest.
SASS_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)")


def _rows(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and data rows (newer ncu releases put a "Kernel Name" line above the header)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(ln for ln in f if ln.startswith('"') or ln[:1].isdigit()))
    start = next(i for i, r in enumerate(rows) if "Address" in r)
    return rows[start], rows[start + 1:]


def _line_map(sass_path: str) -> tuple[dict[int, tuple[str, int]], dict[int, str]]:
    """Instruction offset -> (file, line) and -> opcode, from ``nvdisasm -g -c`` output."""
    where: dict[int, tuple[str, int]] = {}
    opcode: dict[int, str] = {}
    cur = ("?", 0)
    for ln in open(sass_path):
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            cur = (m.group(1).split("/")[-1], int(m.group(2)))
            continue
        m = SASS_INSTR.match(ln)
        if m:
            off = int(m.group(1), 16)
            where[off] = cur
            opcode[off] = m.group(3)
    return where, opcode


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0]
    n = int(args[1]) if len(args) > 1 and args[1].isdigit() else 40
    head, rows = _rows(path)
    samp = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
    src = next((i for i, h in enumerate(head) if h.strip() in ("Source", "# Source")), 1)
    addr = head.index("Address")
    if samp is None:
        print("no sampling column")
        return
    stalls = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    data = []
    for r in rows:
        try:
            data.append((float(r[samp] or 0), int(r[addr], 16), r[src], r))
        except (ValueError, IndexError):
            continue
    total = sum(d[0] for d in data) or 1.0
    print(f"total samples {total:.0f} over {len(data)} instructions")
    if "--sass" not in sys.argv:
        for s, a, text, _ in sorted(data, key=lambda d: -d[0])[:n]:
            print(f"{100 * s / total:5.1f}%  {a:#x}  {text}")
        return
    where, opcode = _line_map(sys.argv[sys.argv.index("--sass") + 1])
    base = min(d[1] for d in data)
    per_line: dict[tuple[str, int], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for s, a, text, r in data:
        op = text.split()[0] if text.split() else ""
        op = text.split()[1] if op.startswith("@") and len(text.split()) > 1 else op
        if opcode.get(a - base, "").split(".")[0] != op.split(".")[0]:
            sys.exit(f"{a - base:#x}: ncu has {op!r}, the disassembly {opcode.get(a - base)!r}: not this kernel's cubin")
        c = per_line[where.get(a - base, ("?", 0))]
        c["all"] += s
        for i in stalls:
            c[head[i][6:]] += float(r[i] or 0)
    for (f, line), c in sorted(per_line.items(), key=lambda kv: -kv[1]["all"])[:n]:
        reasons = sorted(((v, k) for k, v in c.items() if k != "all" and v), reverse=True)[:6]
        top = ", ".join(f"{k} {100 * v / total:.1f}" for v, k in reasons)
        print(f"{100 * c['all'] / total:5.1f}%  {f}:{line}  [{top}]")


if __name__ == "__main__":
    main()
