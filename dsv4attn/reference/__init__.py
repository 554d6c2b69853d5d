"""Plain-PyTorch references: the executable spec of every op in ``dsv4attn.ops``.

Each ``*_ref`` has its op's signature (minus ``impl``), assumes validated input and computes in
fp32; the tests compare every kernel against it and it runs on any device.
"""
