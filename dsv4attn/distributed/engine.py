"""DCPPagedAttentionEngine: a whole model's attention stack with every cache sharded by context.

The decode-context-parallel counterpart of :class:`dsv4attn.serving.engine.PagedAttentionEngine`
(same per-step API, same scheduler): every rank of the DCP group runs the same steps (SPMD) and
holds its interleaved share of each SWA, compressed-KV and indexer-key cache
(:mod:`dsv4attn.distributed.dcp` for the dataflow). Per step the rank's metadata is built once
(:func:`~dsv4attn.distributed.dcp_step.build_dcp_metadata`) and each layer runs
:func:`~dsv4attn.distributed.dcp_step.dcp_layer_step`.

Bookkeeping is the base engine's, over :class:`ShardedManager`: the ``KVCacheManager`` surface in
raw tokens, backed by one manager per cache group that counts what this rank holds (SWA: local
entries with the local window ``max_local(W - 1) + 1``; ``full_mla``: local compressed entries of
the most demanding ratio; compressor states: raw tokens, replicated). Pools per rank: the
context-sized group gets ``num_blocks`` (default: room for ``max_num_reqs`` requests of
``max_model_len`` tokens on the rank that holds most, rank 0); the window-bounded groups are
sized as in one process (never short). :meth:`blocks_to_reserve` counts rank 0's blocks, so a
scheduler's admissions are the same on every rank and no rank runs short. A pool shortfall on
any rank is raised on every rank (one flag all-reduce per step) before anything changes.

Not supported yet: CUDA graphs, speculative rollback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from dsv4attn.distributed.dcp_step import DCPStepMetadata, build_dcp_metadata, dcp_layer_step
from dsv4attn.distributed.interleave import max_local, num_local
from dsv4attn.kv_cache.allocator import KVCacheManager, PoolExhaustedError, cdiv
from dsv4attn.kv_cache.specs import GROUP_C4_STATE, GROUP_C128_STATE, GROUP_FULL_MLA, GROUP_SWA, CacheConfig, GroupSpec
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import PagedAttentionEngine, StepPlan

_STATE_GROUP = {4: GROUP_C4_STATE, 128: GROUP_C128_STATE}


class ShardedManager:
    """``KVCacheManager``'s interface in raw tokens over one manager per group in rank-local units.

    ``groups``: the model's groups (the SWA one with its local window); ``num_blocks``: group ->
    blocks of its pool on this rank; ``ratios``: the compressed ratios of the model.
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: Mapping[str, int], ratios: Sequence[int],
                 rank: int, world_size: int, interleave: int) -> None:
        self.groups = list(groups)
        self.ratios = tuple(ratios)
        self.rank, self.world_size, self.interleave = rank, world_size, interleave
        self.managers = {g.name: KVCacheManager([g], {g.name: num_blocks[g.name]}) for g in self.groups}
        self.pools = {name: m.pools[name] for name, m in self.managers.items()}
        self._num_tokens: dict[Hashable, int] = {}
        self._num_computed: dict[Hashable, int] = {}

    def target(self, group: str, num_tokens: int, rank: int | None = None) -> int:
        """The count ``group``'s own manager covers for a request of ``num_tokens`` raw tokens."""
        rank = self.rank if rank is None else rank
        nl: Callable[[int], int] = lambda n: num_local(n, rank, self.world_size, self.interleave)  # noqa: E731
        if group == GROUP_SWA:
            return nl(num_tokens)
        if group == GROUP_FULL_MLA:  # columns of 256 raw tokens = 256 // r local entries of ratio r
            return max(nl(num_tokens // r) * r for r in self.ratios)
        return num_tokens  # compressor states: replicated windows of raw rows

    # ---- queries ---------------------------------------------------------------------------
    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._num_tokens

    @property
    def requests(self) -> list[Hashable]:
        return list(self._num_tokens)

    def num_tokens(self, req_id: Hashable) -> int:
        return self._num_tokens[self._check(req_id)]

    def num_computed(self, req_id: Hashable) -> int:
        return self._num_computed[self._check(req_id)]

    def num_held(self, req_id: Hashable, group: str | None = None) -> int:
        names = [group] if group is not None else list(self.managers)
        return sum(self.managers[n].num_held(req_id, n) for n in names)

    def blocks_needed_by_group(self, req_id: Hashable | None, num_tokens: int) -> dict[str, int]:
        return {n: m.blocks_needed_by_group(req_id if req_id in self else None, self.target(n, num_tokens))[n]
                for n, m in self.managers.items()}

    def shortfall(self, demand: Mapping[str, int]) -> list:
        return [(n, k, self.pools[n]) for n, k in demand.items() if k > self.pools[n].num_free]

    def block_table(self, req_ids: Sequence[Hashable], group: str, width: int | None = None,
                    device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
        """The rank's table of ``group`` (local entries for SWA and ``full_mla``)."""
        return self.managers[group].block_table(req_ids, group, width, device, out=out)

    # ---- mutations (all or nothing) --------------------------------------------------------
    def add_request(self, req_id: Hashable, num_tokens: int = 0) -> None:
        if req_id in self:
            raise ValueError(f"request {req_id!r} already exists")
        self._raise_if_short(req_id, self.blocks_needed_by_group(None, num_tokens))
        for n, m in self.managers.items():
            m.add_request(req_id, self.target(n, num_tokens))
        self._num_tokens[req_id], self._num_computed[req_id] = num_tokens, 0

    def grow(self, req_id: Hashable, num_tokens: int) -> None:
        if num_tokens < self.num_tokens(req_id):
            raise ValueError(f"num_tokens {num_tokens} < current {self._num_tokens[req_id]} for {req_id!r}")
        self._raise_if_short(req_id, self.blocks_needed_by_group(req_id, num_tokens))
        for n, m in self.managers.items():
            m.grow(req_id, self.target(n, num_tokens))
        self._num_tokens[req_id] = num_tokens

    def truncate(self, req_id: Hashable, num_tokens: int) -> int:
        if not self.num_computed(req_id) <= num_tokens <= self._num_tokens[req_id]:
            raise ValueError(f"num_tokens must be in [{self._num_computed[req_id]}, {self._num_tokens[req_id]}] "
                             f"for {req_id!r}, got {num_tokens}")
        freed = sum(m.truncate(req_id, self.target(n, num_tokens)) for n, m in self.managers.items())
        self._num_tokens[req_id] = num_tokens
        return freed

    def advance(self, req_id: Hashable, num_computed: int) -> int:
        if not self.num_computed(req_id) <= num_computed <= self._num_tokens[req_id]:
            raise ValueError(f"num_computed must be in [{self._num_computed[req_id]}, {self._num_tokens[req_id]}] "
                             f"for {req_id!r}, got {num_computed}")
        freed = sum(m.advance(req_id, self.target(n, num_computed)) for n, m in self.managers.items())
        self._num_computed[req_id] = num_computed
        return freed

    def free(self, req_id: Hashable) -> int:
        self._check(req_id)
        del self._num_tokens[req_id], self._num_computed[req_id]
        return sum(m.free(req_id) for m in self.managers.values())

    def _raise_if_short(self, req_id: Hashable, need: Mapping[str, int]) -> None:
        short = self.shortfall(need)
        if short:
            name, n, p = short[0]
            raise PoolExhaustedError(f"request {req_id!r} needs {n} blocks of group {name!r} on DCP rank "
                                     f"{self.rank}, only {p.num_free} of {p.num_blocks} free")

    def _check(self, req_id: Hashable) -> Hashable:
        if req_id not in self._num_tokens:
            raise KeyError(f"unknown request {req_id!r}")
        return req_id


class DCPPagedAttentionEngine(PagedAttentionEngine):
    """:class:`PagedAttentionEngine` over this rank's context shard of every cache (module doc).

    ``group``: the DCP process group (default: the world); ``interleave``: entries dealt to a
    rank in a row (``cp_kv_cache_interleave_size``; it must divide the entries per block of every
    split cache: 1 or 2 for a model with C128A layers). ``num_blocks`` / ``memory_bytes``: this
    rank's main-group blocks / cache budget. Other arguments as the base class; ``layers`` may
    be tensor-parallel shards (their all-reduce runs over their TP group first).
    """

    # ShardedManager has KVCacheManager's surface (duck-typed; the base engine types its manager
    # as the class it builds).
    manager: ShardedManager  # type: ignore[assignment]

    def __init__(self, layers: Sequence[DeepseekV4Attention], group: Any = None, *, interleave: int = 1,
                 kv_cache_dtype: str = "auto", num_blocks: int | None = None, memory_bytes: int | None = None,
                 max_model_len: int = 65536, max_num_reqs: int = 256, **kwargs: Any) -> None:
        if kwargs.get("max_cached_prefixes", 0):
            raise ValueError("max_cached_prefixes: prefix caching is not supported with decode context "
                             "parallelism yet (use 0)")
        if group is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None:
            raise ValueError("DCPPagedAttentionEngine needs an initialized torch.distributed process group")
        if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
            raise ValueError(f"interleave must be a positive int, got {interleave!r}")
        layers = list(layers)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        ratios = sorted({la.ratio for la in layers if isinstance(la, DeepseekV4Attention)} - {1})
        # get_compressed_slot_mapping (the engines' formula) deals entries within blocks of
        # block_size * world entries: the same as this package's global dealing only when the
        # interleave divides the entries per block of every split cache (SWA 64, C4A 64, C128A 2).
        split = sorted({CacheConfig.swa_block_size} | {CacheConfig.block_size // r for r in ratios})
        if any(bs % interleave for bs in split):
            raise ValueError(f"interleave={interleave} must divide the entries per block of every DCP-split cache "
                             f"({split} for this model)")
        if num_blocks is None and memory_bytes is None and ratios and isinstance(max_model_len, int) \
                and not isinstance(max_model_len, bool) and isinstance(max_num_reqs, int) and max_num_reqs >= 1:
            most = max(num_local(max_model_len // r, 0, world, interleave) * r for r in ratios)
            num_blocks = max_num_reqs * max(1, cdiv(most, CacheConfig.block_size))  # rank 0 holds the most
        super().__init__(layers, kv_cache_dtype, num_blocks=num_blocks, memory_bytes=memory_bytes,
                         max_model_len=max_model_len, max_num_reqs=max_num_reqs, **kwargs)
        self.group, self.rank, self.world_size, self.interleave = group, rank, world, interleave
        window = self.cache_config.sliding_window
        groups = [dataclasses.replace(g, window=max_local(window - 1, world, interleave) + 1)
                  if g.name == GROUP_SWA else g for g in self.manager.groups]
        self.manager = ShardedManager(groups, self.num_blocks, ratios, rank, world, interleave)
        self.builder = None  # type: ignore[assignment]  # the DCP metadata replaces the single-process builder

    def blocks_to_reserve(self, num_tokens: int) -> int:
        """Rank 0's main-group blocks for ``num_tokens`` tokens (it holds the most): the same
        answer on every rank, so a scheduler admits the same requests everywhere."""
        if self.main_group != GROUP_FULL_MLA:
            return 0
        tpb = next(g for g in self.manager.groups if g.name == GROUP_FULL_MLA).tokens_per_block
        return cdiv(self.manager.target(GROUP_FULL_MLA, num_tokens, rank=0), tpb)

    def enable_cuda_graphs(self, buckets: Sequence[int] | None = None, capture: bool = True) -> None:
        raise NotImplementedError("CUDA graphs are not supported with decode context parallelism yet")

    def check_step(self, new_tokens: Mapping[Hashable, int]) -> dict[Hashable, int]:
        """The base checks on this rank, then one all-reduce so that a pool shortfall on any rank
        raises :class:`PoolExhaustedError` on every rank (collective: call it on every rank)."""
        err = None
        try:
            starts = super().check_step(new_tokens)
        except PoolExhaustedError as e:
            err = e
        flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if err is not None:
            raise err
        if int(flag.item()):
            raise PoolExhaustedError("another DCP rank has too few free blocks for this step; no request was "
                                     "changed (give the engine more cache: num_blocks or memory_bytes per rank)")
        return starts

    def _build(self, new_tokens: Mapping[Hashable, int], starts: Mapping[Hashable, int]) -> StepPlan:
        order = sorted(new_tokens, key=lambda rid: new_tokens[rid] > 1)  # decodes first (stable)
        qlens = [new_tokens[rid] for rid in order]
        seq_lens = [starts[rid] + n for rid, n in zip(order, qlens)]
        dev, m = self.device, self.manager
        compressed = {}
        if GROUP_FULL_MLA in self.num_blocks:
            full = m.block_table(order, GROUP_FULL_MLA, device=dev)
            for r in m.ratios:
                state = m.block_table(order, _STATE_GROUP[r], device=dev)
                compressed[r] = (full, self.cache_config.block_size // r, state)
        meta = build_dcp_metadata(
            qlens, seq_lens, m.block_table(order, GROUP_SWA, device=dev), self.cache_config.swa_block_size,
            self.cache_config.sliding_window, compressed, self.rank, self.world_size, self.interleave, dev, self.impl)
        # StepPlan.metadata is typed for the single-process engine; _run_layer reads this one back.
        return StepPlan(tuple(order), tuple(qlens), tuple(starts[rid] for rid in order), meta, {})  # type: ignore[arg-type]

    def _run_layer(self, i: int, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        with torch.no_grad():
            return dcp_layer_step(self.layers[i], hidden, cast(DCPStepMetadata, plan.metadata), self.caches[i],
                                  self.group, self.impl)
