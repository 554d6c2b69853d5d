"""``python -m dsv4attn JOB`` (also the ``dsv4attn`` console script); see :mod:`dsv4attn.serving.cli`."""

import sys

from dsv4attn.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
