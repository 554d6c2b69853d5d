"""Triton kernels: ``@triton.jit`` functions only, no policy (launchers live in ``dsv4attn.ops``).

- ``common``: shared helpers (the entry -> block table -> slot formula, int64 page offsets,
  integer e4m3 / bf16 encoders);
- ``cache_ops``: cache writers; ``metadata``: per-step metadata; ``sparse_attn*``: attention.
"""
