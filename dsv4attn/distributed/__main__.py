"""``torchrun --nproc-per-node N -m dsv4attn.distributed --tp T --dcp D --check``: the parity check
of the parallel runners against one process (see :mod:`dsv4attn.distributed.launch`)."""

import sys

from dsv4attn.distributed.launch import main

sys.exit(main())
