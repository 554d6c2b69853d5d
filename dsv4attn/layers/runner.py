"""AttentionRunner: one attention layer serving many requests over its own paged caches.

The runner owns the layer's caches (``dsv4attn.kv_cache.specs`` geometry), the block manager
(``KVCacheManager``: one pool, per-request tables per group, sliding groups release blocks no
future token can read) and the per-step metadata builder. ``step(chunks)`` runs one batch:
every request's new tokens, any mix of first chunks, later chunks and decode tokens, in one
metadata build and one launch per op (see :mod:`dsv4attn.layers.paged`).

Errors (``ValueError``/``TypeError``/``KeyError``/``PoolExhaustedError``) are raised before any
state changes, so a bad request never disturbs the others' caches.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from dsv4attn.kv_cache.allocator import KVCacheManager, PoolExhaustedError
from dsv4attn.kv_cache.layout import alloc_fp8_ds_mla_cache, layout_for_head_dim
from dsv4attn.kv_cache.specs import CacheConfig, cache_groups, layer_cache_specs
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.paged import LayerCaches, layer_step
from dsv4attn.metadata import GROUP_FULL_MLA, GROUP_SWA, BatchMetadata, MetadataConfig, StepMetadataBuilder
from dsv4attn.reference.cache_ops import alloc_indexer_k_cache

KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
#: Ratios the paged caches and metadata support (vLLM accepts only these).
PAGED_RATIOS = (1, 4, 128)


class AttentionRunner:
    """Runs ``layer`` for many requests at once over paged caches.

    Args:
        layer: a ``DeepseekV4Attention`` (its parameter dtype is the compute dtype).
        kv_cache_dtype: "auto" (cache rows in the layer's dtype) or "fp8_ds_mla" (584-byte
            entries in production, indexer keys fp8 + fp32 scale).
        num_blocks: blocks in the shared pool (every cache of the layer has this many blocks).
        device: where caches and compute live (default: the layer's device).
        max_num_batched_tokens / max_num_reqs: per-step limits; max_model_len: per-request limit.
        impl: kernel path of every op ("auto" | "triton" | "reference").
    """

    def __init__(
        self,
        layer: DeepseekV4Attention,
        kv_cache_dtype: str = "auto",
        num_blocks: int = 256,
        device: torch.device | str | None = None,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 65536,
        max_num_reqs: int = 256,
        impl: str = "auto",
    ) -> None:
        if not isinstance(layer, DeepseekV4Attention):
            raise TypeError(f"layer must be a DeepseekV4Attention, got {type(layer).__name__}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if layer.ratio not in PAGED_RATIOS:
            raise ValueError(f"paged caches support compress ratios {PAGED_RATIOS}, layer has {layer.ratio}")
        for name, v in (("num_blocks", num_blocks), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("max_num_reqs", max_num_reqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        cfg = layer.config
        self.layer = layer
        self.device = dev = torch.device(device) if device is not None else layer.sinks.device
        if dev.type == "cuda" and dev.index is None:
            self.device = dev = torch.device("cuda", torch.cuda.current_device())
        if layer.sinks.device != dev:
            raise ValueError(f"layer parameters are on {layer.sinks.device}, runner device is {dev}: move the layer")
        self.dtype = layer.sinks.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"layer dtype must be float32 or bfloat16, got {self.dtype}")
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_reqs = max_num_reqs
        self.impl = impl
        ratio = layer.ratio
        self.cache_config = CacheConfig(
            compress_ratios=(ratio,), head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
            index_head_dim=cfg.index_head_dim, sliding_window=cfg.window_size,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.manager = KVCacheManager(cache_groups(self.cache_config), num_blocks)
        specs = {s.name: s for s in layer_cache_specs(self.cache_config, 0)}
        self.specs = specs
        layout = layout_for_head_dim(cfg.head_dim, cfg.rope_dim) if kv_cache_dtype == "fp8_ds_mla" else None

        def kv_cache(block_size: int) -> torch.Tensor:
            if kv_cache_dtype == "fp8_ds_mla":
                return alloc_fp8_ds_mla_cache(num_blocks, block_size, layout, device=dev)
            return torch.zeros(num_blocks, block_size, cfg.head_dim, dtype=self.dtype, device=dev)

        def state(name: str) -> torch.Tensor:
            s = specs[name]
            return torch.zeros(num_blocks, s.block_size, *s.row_shape, dtype=torch.float32, device=dev)

        caches = LayerCaches(kv_cache_dtype, layout, swa=kv_cache(specs["swa_kv"].block_size))
        if ratio > 1:
            caches.compressed = kv_cache(specs["compressed_kv"].block_size)
            caches.state = state("compressor_state")
        if ratio == 4:
            bs = specs["indexer_k"].block_size
            if kv_cache_dtype == "fp8_ds_mla":
                caches.indexer_k = alloc_indexer_k_cache(num_blocks, bs, cfg.index_head_dim, device=dev)
            else:
                caches.indexer_k = torch.zeros(num_blocks, bs, cfg.index_head_dim, dtype=self.dtype, device=dev)
            caches.indexer_state = state("indexer_compressor_state")
        self.caches = caches
        self.state_group = {4: "c4_state", 128: "c128_state"}.get(ratio)
        self.builder = StepMetadataBuilder(MetadataConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_reqs=max_num_reqs, max_model_len=max_model_len,
            num_blocks=num_blocks, window_size=cfg.window_size,
            compress_ratios=(ratio,) if ratio > 1 else (), swa_block_size=specs["swa_kv"].block_size,
            index_topk=cfg.index_topk, form="range",
        ), dev)

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def requests(self) -> list[Hashable]:
        """Ids of the live requests."""
        return self.manager.requests

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` already processed (raises ``KeyError`` if unknown)."""
        return self.manager.num_computed(request_id)

    @property
    def num_free_blocks(self) -> int:
        return self.manager.pool.num_free

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks; ``KeyError`` for an unknown id."""
        if request_id not in self.manager:
            raise KeyError(f"unknown request {request_id!r}")
        self.manager.free(request_id)

    # ---- one step ----------------------------------------------------------------------------
    def _validate(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, int]:
        if not isinstance(chunks, Mapping):
            raise TypeError(f"chunks must be a dict request_id -> hidden states, got {type(chunks).__name__}")
        hs = self.layer.config.hidden_size
        starts: dict[Hashable, int] = {}
        total = 0
        for rid, x in chunks.items():
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"chunks[{rid!r}] must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 2 or x.shape[1] != hs:
                raise ValueError(f"chunks[{rid!r}] must be [n, {hs}], got shape {tuple(x.shape)}")
            if x.shape[0] == 0:
                raise ValueError(f"chunks[{rid!r}] is empty: every request in a step needs >= 1 token")
            if x.dtype != self.dtype or x.device != self.device:
                raise ValueError(f"chunks[{rid!r}] must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")
            start = self.manager.num_computed(rid) if rid in self.manager else 0
            if start + x.shape[0] > self.max_model_len:
                raise ValueError(f"request {rid!r} would reach {start + x.shape[0]} tokens > max_model_len="
                                 f"{self.max_model_len}")
            starts[rid] = start
            total += x.shape[0]
        if total > self.max_num_batched_tokens:
            raise ValueError(f"step has {total} tokens > max_num_batched_tokens={self.max_num_batched_tokens}")
        if len(chunks) > self.max_num_reqs:
            raise ValueError(f"step has {len(chunks)} requests > max_num_reqs={self.max_num_reqs}")
        need = sum(self.manager.blocks_needed(rid if rid in self.manager else None, starts[rid] + x.shape[0])
                   for rid, x in chunks.items())
        if need > self.num_free_blocks:
            raise PoolExhaustedError(f"step needs {need} blocks, only {self.num_free_blocks} free; "
                                     "no request was changed")
        return starts

    @torch.no_grad()
    def step(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """Run one step. chunks: request id -> hidden ``[n_i, hidden_size]`` (layer dtype, device).

        New ids start at position 0; known ids continue where they stopped. Returns id ->
        output ``[n_i, hidden_size]``. An empty dict returns an empty dict.
        """
        starts = self._validate(chunks)
        if not chunks:
            return {}
        for rid, x in chunks.items():
            end = starts[rid] + x.shape[0]
            if rid in self.manager:
                self.manager.grow(rid, end)
            else:
                self.manager.add_request(rid, end)
        # decodes first (the metadata's batch order), otherwise in the caller's order
        order = sorted(chunks, key=lambda rid: chunks[rid].shape[0] > 1)
        qlens = [chunks[rid].shape[0] for rid in order]
        seq_lens = [starts[rid] + n for rid, n in zip(order, qlens)]
        dev = self.device
        tables = {GROUP_SWA: self.manager.block_table(order, "swa", device=dev)}
        if self.layer.ratio > 1:
            tables[GROUP_FULL_MLA] = self.manager.block_table(order, GROUP_FULL_MLA, device=dev)
        batch = BatchMetadata.from_requests(qlens, seq_lens, tables, swa_block_size=self.specs["swa_kv"].block_size,
                                            device=dev)
        step_meta = self.builder.build(batch, impl=self.impl)
        state_table = self.manager.block_table(order, self.state_group, device=dev) if self.state_group else None
        hidden = torch.cat([chunks[rid] for rid in order])
        out = layer_step(self.layer, hidden, step_meta, self.builder, self.caches, state_table, impl=self.impl)
        result, t0 = {}, 0
        for rid, n in zip(order, qlens):
            result[rid] = out[t0:t0 + n]
            t0 += n
            self.manager.advance(rid, starts[rid] + n)
        return {rid: result[rid] for rid in chunks}
