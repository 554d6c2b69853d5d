"""`make demo`: the main job.

1. One synthetic mixed step through every metadata builder (what each produced, bytes per form).
2. A stack of the three DeepSeek-V4 attention layer kinds serving a workload of many requests
   (chunked prefill + decode) over paged caches, verified request by request against the
   transformers reference model.

    python -m dsv4attn.demo [layer-demo options, see python -m dsv4attn.layers.demo --help]
"""

from __future__ import annotations

import sys

from dsv4attn import metadata_demo
from dsv4attn.layers import demo as layer_demo


def main(argv: list[str] | None = None) -> None:
    print("=" * 100)
    print("Part 1: per-step metadata (one mixed step, three forms)")
    print("=" * 100)
    metadata_demo.run()
    print()
    print("=" * 100)
    print("Part 2: DeepSeek-V4 attention layers over the paged backend vs transformers")
    print("=" * 100)
    layer_demo.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
