"""Paged KV caches: one module per concept.

- ``layout``: the page formats (fp8_ds_mla, indexer-key, compressor-state) and their byte
  arithmetic, cache-dtype names;
- ``slots``: the entry -> block table -> slot formula and the C128A alignment;
- ``specs``: which caches each layer kind owns, the cache groups and their names;
- ``allocator``: block pool and per-request block tables; ``accounting``: memory footprints.
"""
