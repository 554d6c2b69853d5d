"""Top SASS lines by warp-stall samples from ``ncu --page source --print-source sass --csv``.

    python3 -m scripts.ncu_top source.csv [N]
"""

from __future__ import annotations

import csv
import sys


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"') or ln[:1].isdigit()]
    rows = list(csv.reader(lines))
    head = rows[0]
    print(head)
    samp = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
    src = next((i for i, h in enumerate(head) if h.strip() in ("Source", "# Source")), 1)
    addr = next((i for i, h in enumerate(head) if "Address" in h), 0)
    if samp is None:
        print("no sampling column")
        return
    data = []
    for r in rows[1:]:
        try:
            data.append((float(r[samp] or 0), r[addr], r[src]))
        except (ValueError, IndexError):
            continue
    total = sum(d[0] for d in data) or 1.0
    print(f"total samples {total:.0f} over {len(data)} instructions")
    for s, a, text in sorted(data, reverse=True)[:n]:
        print(f"{100 * s / total:5.1f}%  {a}  {text}")


if __name__ == "__main__":
    main()
