"""Decode context parallelism (DCP): one layer's KV caches sharded across ranks by context.

Every rank of the DCP group sees every token of a step (queries, compressors and the indexer's
queries are replicated) but holds only its interleaved share of each cache that grows with the
context (:mod:`dsv4attn.distributed.interleave`):

- SWA KV: raw position ``p`` is entry ``p`` of the SWA stream (slots from
  ``get_compressed_slot_mapping`` with ratio 1 and the CP arguments);
- compressed KV and, for CSA, the indexer keys: entry ``k`` of the compressed stream (slots from
  ``get_compressed_slot_mapping`` with the layer's ratio and the CP arguments); a rank builds
  only the entries it owns;
- compressor states (a window of ``2r`` or ``r`` raw rows, bounded) are replicated.

One step, on every rank: write the owned SWA row and compressed entries; CSA: score the owned
indexer keys, keep the local top-k, all-gather (score, global entry) candidates and select the
global top-k (identical on every rank: score descending, lower entry first, as one process does),
then keep the entries this rank owns as local slots; attend over the local candidates without
the sink (the op returns out and the natural-log lse); all-gather the lse and weight the local
output by ``exp(lse_i - lse) / (1 + exp(sink - lse))`` (the sink applied once, after the merge);
project the weighted partial (linear) and all-reduce it in hidden space: one ``[T, H]`` all-gather
and one ``[T, hidden]`` all-reduce per layer.

Memory per rank for a long request falls by the DCP size: a rank holds ``cdiv(n / w, bs)`` blocks
of each compressed cache where one process holds ``cdiv(n, bs)``.

The step itself is :mod:`dsv4attn.distributed.dcp_step` (metadata built once per step, then one
call per layer); :class:`DCPAttentionRunner` adds the per-rank block tables and caches of one layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dsv4attn.distributed.dcp_step import build_dcp_metadata, dcp_layer_step
from dsv4attn.distributed.interleave import max_local, num_local
from dsv4attn.kv_cache.allocator import KVCacheManager, PoolExhaustedError
from dsv4attn.kv_cache.specs import CacheConfig, cache_groups, layer_cache_specs
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.paged import alloc_layer_caches
from dsv4attn.serving.runner import KV_CACHE_DTYPES, PAGED_RATIOS, check_chunks

#: Default tokens per grow/advance of :meth:`DCPAttentionRunner.reserve`.
RESERVE_CHUNK = 256


class DCPAttentionRunner:
    """Runs ``layer`` for many requests with its caches sharded over ``group`` (see module doc).

    SPMD: every rank calls :meth:`step` / :meth:`free` with the same arguments in the same order,
    and every rank returns the full output. ``layer`` may itself be a tensor-parallel shard
    (:class:`~dsv4attn.distributed.tp.TPAttention`), whose own all-reduce then runs over its TP
    group. ``interleave``: entries dealt to a rank in a row (``cp_kv_cache_interleave_size``).
    ``num_blocks``: blocks of each cache on this rank. Other arguments as ``AttentionRunner``.
    Errors are raised before any state changes.
    """

    def __init__(
        self,
        layer: DeepseekV4Attention,
        group: Any = None,
        *,
        interleave: int = 1,
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
                        ("max_model_len", max_model_len), ("max_num_reqs", max_num_reqs),
                        ("interleave", interleave)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if group is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            raise ValueError("DCPAttentionRunner needs an initialized torch.distributed process group")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.interleave = interleave
        cfg = layer.config
        self.layer = layer
        dev = torch.device(device) if device is not None else layer.sinks.device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if layer.sinks.device != dev:
            raise ValueError(f"layer parameters are on {layer.sinks.device}, runner device is {dev}: move the layer")
        self.device = dev
        self.dtype = layer.sinks.dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"layer dtype must be float32 or bfloat16, got {self.dtype}")
        self.kv_cache_dtype, self.impl = kv_cache_dtype, impl
        self.max_model_len, self.max_num_batched_tokens, self.max_num_reqs = (
            max_model_len, max_num_batched_tokens, max_num_reqs)
        ratio = layer.ratio
        self.cache_config = CacheConfig(
            compress_ratios=(ratio,), head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
            index_head_dim=cfg.index_head_dim, sliding_window=cfg.window_size, kv_cache_dtype=kv_cache_dtype)
        groups = {g.name: g for g in cache_groups(self.cache_config)}
        # The SWA table counts LOCAL entries: the next token reads local entries from
        # num_local(p - W + 1), at most max_local(W - 1) below num_local(p).
        groups["swa"] = dataclasses.replace(groups["swa"], window=max_local(cfg.window_size - 1, self.world_size,
                                                                            interleave) + 1)
        # One manager (and pool) per group: the SWA and compressed tables count LOCAL entries.
        self.managers = {name: KVCacheManager([g], num_blocks) for name, g in groups.items()}
        self.state_group = {4: "c4_state", 128: "c128_state"}.get(ratio)
        self.specs = {s.name: s for s in layer_cache_specs(self.cache_config, 0)}
        # get_compressed_slot_mapping (the engine's formula) deals entries within each block of
        # block_size * world entries; it equals the global dealing of this module only when the
        # interleave divides every split cache's block size (otherwise the engine's offsets run
        # past the block).
        split_bs = [c.block_size for c in self.specs.values() if c.group != self.state_group]
        if any(bs % interleave for bs in split_bs):
            raise ValueError(f"interleave={interleave} must divide the block size of every DCP-split cache "
                             f"({sorted(set(split_bs))} entries for this layer)")
        self.caches = alloc_layer_caches(layer, self.specs, kv_cache_dtype, lambda group: num_blocks, dev, self.dtype)
        self._computed: dict[Hashable, int] = {}

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def requests(self) -> list[Hashable]:
        return list(self._computed)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` already processed (raises ``KeyError`` if unknown)."""
        if request_id not in self._computed:
            raise KeyError(f"unknown request {request_id!r}")
        return self._computed[request_id]

    @property
    def free_blocks(self) -> dict[str, int]:
        """Free blocks of each group's pool on this rank (one pool per group, unlike
        ``AttentionRunner.num_free_blocks``)."""
        return {name: m.pool.num_free for name, m in self.managers.items()}

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks on this rank; ``KeyError`` for an unknown id."""
        if request_id not in self._computed:
            raise KeyError(f"unknown request {request_id!r}")
        for m in self.managers.values():
            m.free(request_id)
        del self._computed[request_id]

    def reserve(self, request_id: Hashable, num_tokens: int, chunk: int = RESERVE_CHUNK) -> None:
        """Register a new request whose first ``num_tokens`` tokens count as computed without
        running them: their blocks are allocated on this rank and hold whatever the pages hold
        (benchmarks of long contexts). Call on every rank. Sliding groups are advanced in
        ``chunk``-token steps, so they hold at most a chunk of blocks at a time (each step costs
        host time linear in the request's table length); on :class:`PoolExhaustedError` nothing
        is kept."""
        if request_id in self._computed:
            raise ValueError(f"request {request_id!r} already exists")
        n_ok = isinstance(num_tokens, int) and not isinstance(num_tokens, bool)
        if not n_ok or not 1 <= num_tokens < self.max_model_len:
            raise ValueError(f"num_tokens must be an int in [1, max_model_len={self.max_model_len}), "
                             f"got {num_tokens!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        for m in self.managers.values():
            m.add_request(request_id, 0)
        try:
            for end in [*range(chunk, num_tokens, chunk), num_tokens]:
                for name, k in self._targets(end).items():
                    self.managers[name].grow(request_id, k)
                    self.managers[name].advance(request_id, k)
        except PoolExhaustedError:
            for m in self.managers.values():
                m.free(request_id)
            raise
        self._computed[request_id] = num_tokens

    def held_bytes(self, request_id: Hashable) -> dict[str, int]:
        """Cache bytes ``request_id`` holds on this rank, per cache name."""
        self.seq_len(request_id)
        c = self.caches
        out = {}
        for name, t, group in (("swa_kv", c.swa, "swa"), ("compressed_kv", c.compressed, "full_mla"),
                               ("indexer_k", c.indexer_k, "full_mla"), ("compressor_state", c.state, self.state_group),
                               ("indexer_compressor_state", c.indexer_state, self.state_group)):
            if t is not None:
                assert group is not None  # a state cache exists only with its state group
                out[name] = self.managers[group].num_held(request_id) * t.stride(0) * t.element_size()
        return out

    def _targets(self, end: int) -> dict[str, int]:
        """Per group, the token count its manager must cover for a request of ``end`` tokens."""
        nl: Callable[[int], int] = lambda n: num_local(n, self.rank, self.world_size, self.interleave)  # noqa: E731
        r = self.layer.ratio
        out = {"swa": nl(end)}
        if r > 1:
            assert self.state_group is not None  # ratio 4 or 128
            out["full_mla"] = nl(end // r) * r  # cdiv(local entries, 256 // r) columns of 256 raw tokens
            out[self.state_group] = end
        return out

    # ---- one step ----------------------------------------------------------------------------
    def _validate(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, int]:
        check_chunks(chunks, self.layer.config.hidden_size, self.dtype, self.device)
        starts, total = {}, 0
        for rid, x in chunks.items():
            start = self._computed.get(rid, 0)
            if start + x.shape[0] > self.max_model_len:
                raise ValueError(f"request {rid!r} would reach {start + x.shape[0]} tokens > max_model_len="
                                 f"{self.max_model_len}")
            starts[rid] = start
            total += x.shape[0]
        if total > self.max_num_batched_tokens:
            raise ValueError(f"step has {total} tokens > max_num_batched_tokens={self.max_num_batched_tokens}")
        if len(chunks) > self.max_num_reqs:
            raise ValueError(f"step has {len(chunks)} requests > max_num_reqs={self.max_num_reqs}")
        for name, m in self.managers.items():
            need = sum(m.blocks_needed(rid if rid in m else None, self._targets(starts[rid] + x.shape[0])[name])
                       for rid, x in chunks.items())
            if need > m.pool.num_free:
                raise PoolExhaustedError(f"step needs {need} {name} blocks on DCP rank {self.rank}, only "
                                         f"{m.pool.num_free} free; no request was changed")
        return starts

    @torch.no_grad()
    def step(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """Run one step (same contract as ``AttentionRunner.step``; call it on every rank)."""
        starts = self._validate(chunks)
        if not chunks:
            return {}
        for rid, x in chunks.items():
            for name, n in self._targets(starts[rid] + x.shape[0]).items():
                m = self.managers[name]
                if rid in m:
                    m.grow(rid, n)
                else:
                    m.add_request(rid, n)
        order = sorted(chunks, key=lambda rid: chunks[rid].shape[0] > 1)  # decodes first
        qlens = [chunks[rid].shape[0] for rid in order]
        seq_lens = [starts[rid] + n for rid, n in zip(order, qlens)]
        hidden = torch.cat([chunks[rid] for rid in order])
        out = self._run(order, qlens, seq_lens, hidden)
        result, t0 = {}, 0
        for rid, n, end in zip(order, qlens, seq_lens):
            result[rid] = out[t0:t0 + n]
            t0 += n
            for name, k in self._targets(end).items():
                self.managers[name].advance(rid, k)
            self._computed[rid] = end
        return {rid: result[rid] for rid in chunks}

    def _run(self, order: list, qlens: list[int], seq_lens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        dev, r = self.device, self.layer.ratio
        compressed = {}
        if r > 1:
            assert self.caches.compressed is not None and self.state_group is not None  # a compressed layer
            compressed[r] = (self.managers["full_mla"].block_table(order, "full_mla", device=dev),
                             self.caches.compressed.shape[1],
                             self.managers[self.state_group].block_table(order, self.state_group, device=dev))
        meta = build_dcp_metadata(
            qlens, seq_lens, self.managers["swa"].block_table(order, "swa", device=dev), self.caches.swa.shape[1],
            self.layer.config.window_size, compressed, self.rank, self.world_size, self.interleave, dev, self.impl)
        return dcp_layer_step(self.layer, hidden, meta, self.caches, self.group, self.impl)
