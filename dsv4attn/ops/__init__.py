"""Public ops: validate -> allocate -> dispatch (``impl="auto" | "triton" | "reference"``) -> launch.

- ``cache_ops``: ``insert_kv``, ``insert_indexer_k``, ``write_compressor_state``;
- ``metadata``: the engine-compatible ``get_compressed_slot_mapping`` and
  ``build_c128a_topk_metadata`` plus SWA / top-k / range metadata ops;
- ``candidate_set`` + ``sparse_attn``: sparse MLA attention with sink over candidate sets
  (``sparse_attn_launch``: kernel choice; ``launch_cache`` and ``call_plan``: the eager host
  cost of repeated launches and calls);
- ``indexer``: ``indexer_topk`` (lightning-indexer scores over paged keys + deterministic top-k);
- ``compressor``: ``compressor_pool`` (gated softmax pooling of completed windows from paged state);
- ``norm_rope``: ``norm_rope`` (RMSNorm + interleaved RoPE in one kernel) and ``rope_cos_sin``.

Each op validates its arguments once, at this boundary (clear ``TypeError``/``ValueError``
naming the argument, before any output or cache changes); kernels assume validated input.
"""
