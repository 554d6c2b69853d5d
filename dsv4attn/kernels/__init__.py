"""Triton kernels: ``@triton.jit`` functions (and, for Hopper, ``@gluon.jit``) only, no policy (launchers
live in ``dsv4attn.ops``).

- ``common``: shared helpers (the entry -> block table -> slot formula, int64 page offsets,
  integer e4m3 / bf16 encoders);
- ``cache_ops``: cache writers; ``metadata``: per-step metadata; ``sparse_attn*``: attention
  (``sparse_attn_sm90``, ``sparse_attn_sm90_ws``: the Gluon kernels for Hopper, imported only where they
  can run).
"""
