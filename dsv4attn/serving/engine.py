"""PagedAttentionEngine: the per-step API that serves every attention layer of a model at once.

One engine owns the paged caches of a stack of ``DeepseekV4Attention`` layers, one
``KVCacheManager`` (one block table per request per cache group, one pool per group sized by
that group's geometry: :func:`dsv4attn.kv_cache.accounting.plan_num_blocks`) and one
``StepMetadataBuilder``. A step is::

    plan = engine.begin_step({"a": 17, "b": 1})   # request -> new tokens; validates, allocates,
                                                  # builds the metadata ONCE for all layers
    out_i = engine.run_layer(i, hidden_i)         # [plan.num_tokens, hidden] in plan.order
    engine.end_step()                             # tokens are now in the caches
    engine.free("a")

``begin_step`` checks everything (ids, counts, limits, every group's pool) before it takes a
block, and undoes its allocation if building the metadata fails, so a refused step changes
nothing. Between ``begin_step`` and ``end_step`` the caller runs every layer once, in any order
(layers do not read each other's caches). ``abort_step`` gives the step's blocks back instead.

Speculative decoding (``num_speculative_tokens = k``): a request with up to ``1 + k`` new tokens
is a decode (the metadata's ``decode_threshold``); after verification ``rollback(request, r)``
takes its last ``r`` tokens back exactly (see :mod:`dsv4attn.serving.spec`) and ``commit``
marks the rest accepted.

The single-layer :class:`dsv4attn.serving.runner.AttentionRunner` and the model wrapper
:class:`dsv4attn.serving.model.PagedDeepseekV4` are both thin clients of this class.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsv4attn.device import resolve_impl
from dsv4attn.kv_cache.accounting import main_group, plan_num_blocks
from dsv4attn.kv_cache.allocator import KVCacheManager, PoolExhaustedError, PrefixHold, cdiv
from dsv4attn.kv_cache.specs import (
    GROUP_C4_STATE,
    GROUP_C128_STATE,
    GROUP_FULL_MLA,
    GROUP_SWA,
    CacheConfig,
    cache_groups,
    layer_cache_specs,
)
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.metadata import BatchMetadata, MetadataConfig, StepMetadata, StepMetadataBuilder
from dsv4attn.serving.paged import (
    CACHE_FIELD_SPECS, LayerCaches, StepTables, alloc_layer_caches, layer_step, state_window,
)
from dsv4attn.serving.prefix_cache import PrefixBlob

if TYPE_CHECKING:  # graphs imports this module; the engine imports it lazily
    from dsv4attn.serving.graphs import DecodeGraphs

KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
#: Ratios the paged caches and metadata support (vLLM accepts only these).
PAGED_RATIOS = (1, 4, 128)
#: Most draft tokens verified per request and step (DeepSeek-V4 MTP uses 1-4; next_n up to 8).
MAX_SPECULATIVE_TOKENS = 7
_STATE_GROUP = {4: GROUP_C4_STATE, 128: GROUP_C128_STATE}
#: Eager steps' block tables are as wide as the longest row rounded up to this: Triton
#: specialises integer arguments (table widths and strides) on divisibility by 16, so a width that
#: follows the context would compile new kernel variants while serving (see ``warmup``).
TABLE_ALIGN = 16


def _page_numel(t: torch.Tensor) -> int:
    """Elements of one block's page of a cache tensor (its block stride)."""
    return t.stride(0)


def _pages(t: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page elements]`` view of a cache tensor's whole pages (entries, scales and
    padding: every byte of a block), over the buffer it was allocated in."""
    page = _page_numel(t)
    assert t.untyped_storage().nbytes() >= (t.storage_offset() + t.shape[0] * page) * t.element_size()
    return t.as_strided((t.shape[0], page), (page, 1), t.storage_offset())


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class StepPlan:
    """What ``begin_step`` decided: batch order (decodes first), per-request new tokens and
    tokens before the step, each request's token rows ``[offset, offset + n)`` of the step."""

    order: tuple[Hashable, ...]
    query_lens: tuple[int, ...]
    starts: tuple[int, ...]
    metadata: StepMetadata
    state_tables: Mapping[int, torch.Tensor]  # ratio -> windowed state table (see layer_step)
    bucket: int | None = None  # decode step padded to this CUDA-graph bucket (None: eager)
    state_positions: Mapping[int, torch.Tensor] | None = None  # ratio -> positions in the windowed table
    tables: StepTables = field(default_factory=StepTables)  # per-step values its layers share

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def offsets(self) -> dict[Hashable, tuple[int, int]]:
        """request -> (first row, rows) in the step's flat token order."""
        out, t0 = {}, 0
        for rid, n in zip(self.order, self.query_lens):
            out[rid] = (t0, n)
            t0 += n
        return out

    def positions(self) -> torch.Tensor:
        """int64 [T] (host) position of every token of the step."""
        return self.metadata.batch.positions_cpu

    def state(self, ratio: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(state table, state positions)`` a layer of compress ``ratio`` hands ``layer_step``
        (the windowed table and the positions relative to it; ``(None, None)`` for ratio 1)."""
        sp = self.state_positions.get(ratio) if self.state_positions is not None else None
        return self.state_tables.get(ratio), sp


class PagedAttentionEngine:
    """Serves ``layers`` (one model's attention stack, all one ``AttentionConfig``) over paged caches.

    Args:
        layers: ``DeepseekV4Attention`` modules; ``layers[i]`` is run by ``run_layer(i, ...)``
            (parameter dtype = compute dtype, float32 or bfloat16; all on ``device``).
        kv_cache_dtype: "auto" (cache rows in the layer dtype) or "fp8_ds_mla".
        num_blocks: blocks of the context-sized group (``full_mla``: 256-token columns of the
            compressed caches); the window-bounded groups are sized from ``max_num_reqs`` /
            ``max_num_batched_tokens`` and never run short (in a model of sliding layers only,
            num_blocks sizes the SWA group instead). ``memory_bytes``: a cache budget instead
            (what the window groups leave goes to the full group).
            Neither: room for ``max_num_reqs`` requests of ``max_model_len`` tokens.
        max_num_batched_tokens / max_num_reqs (live requests): per-step / engine limits;
        max_model_len: per-request limit. impl: kernel path of every op.
        num_speculative_tokens: k (0..7): steps of up to 1 + k tokens per request go down the
            decode path, and a request can roll back up to k computed tokens since its last
            commit (sliding-window blocks are kept that much longer; pools sized for it).
        deterministic: batch-invariant attention: no split-KV chosen from the batch, so a
            request's output bits do not depend on which requests share its steps (default
            False: split-KV from a wave model of the batch, faster at small batches).
        max_cached_prefixes: prefix holds (:meth:`save_prefix`) the engine keeps at most at once;
            the window-bounded pools get room for them (0: prefix caching off).
    """

    def __init__(
        self,
        layers: Sequence[DeepseekV4Attention],
        kv_cache_dtype: str = "auto",
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        device: torch.device | str | None = None,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 65536,
        max_num_reqs: int = 256,
        impl: str = "auto",
        num_speculative_tokens: int = 0,
        deterministic: bool = False,
        max_cached_prefixes: int = 0,
    ) -> None:
        layers = list(layers)
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        self.deterministic = deterministic
        if not layers:
            raise ValueError("layers must hold at least one DeepseekV4Attention")
        for i, layer in enumerate(layers):
            if not isinstance(layer, DeepseekV4Attention):
                raise TypeError(f"layers[{i}] must be a DeepseekV4Attention, got {type(layer).__name__}")
            if layer.ratio not in PAGED_RATIOS:
                raise ValueError(f"paged caches support compress ratios {PAGED_RATIOS}, layers[{i}] has {layer.ratio}")
            if layer.config is not layers[0].config and layer.config != layers[0].config:
                raise ValueError(f"layers[{i}] has a different AttentionConfig from layers[0]")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        for name, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_model_len", max_model_len),
                        ("max_num_reqs", max_num_reqs)):
            _positive(name, v)
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        self.num_speculative_tokens = k
        if isinstance(max_cached_prefixes, bool) or not isinstance(max_cached_prefixes, int) or max_cached_prefixes < 0:
            raise ValueError(f"max_cached_prefixes must be an int >= 0, got {max_cached_prefixes!r}")
        self.max_cached_prefixes = max_cached_prefixes
        cfg = layers[0].config
        pdev = layers[0].sinks.device
        dev = torch.device(device) if device is not None else pdev
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        dtype = layers[0].sinks.dtype
        for i, layer in enumerate(layers):
            if layer.sinks.device != dev:
                raise ValueError(f"layers[{i}] parameters are on {layer.sinks.device}, engine device is {dev}")
            if layer.sinks.dtype != dtype:
                raise ValueError(f"layers[{i}] is {layer.sinks.dtype}, layers[0] is {dtype}: one dtype per engine")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"layer dtype must be float32 or bfloat16, got {dtype}")
        self.impl = resolve_impl(impl, dev) if dev.type != "meta" else "reference"  # refuses a bad path now
        if dev.type == "cuda":
            for layer in layers:  # one GEMM for all projections of a layer's input (values unchanged)
                layer.fuse_input_projections()
        self.layers, self.device, self.dtype = layers, dev, dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len, self.max_num_reqs = max_model_len, max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_config = CacheConfig(
            compress_ratios=tuple(layer.ratio for layer in layers), head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
            index_head_dim=cfg.index_head_dim, sliding_window=cfg.window_size, kv_cache_dtype=kv_cache_dtype,
        )
        self.num_blocks = plan_num_blocks(
            self.cache_config, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, num_blocks=num_blocks, memory_bytes=memory_bytes, rollback_tokens=k,
            prefix_holds=max_cached_prefixes)
        self.main_group = main_group(self.cache_config).name
        self.manager = KVCacheManager(cache_groups(self.cache_config), self.num_blocks, rollback_tokens=k)
        self._tokens_per_block = {g.name: g.tokens_per_block for g in self.manager.groups}
        self.caches = [self._alloc_caches(i) for i in range(len(layers))]
        ratios = tuple(sorted({layer.ratio for layer in layers if layer.ratio > 1}))
        swa_bs = self.cache_config.swa_block_size
        nb = {g: self.num_blocks[g] for g in (GROUP_SWA, GROUP_FULL_MLA) if g in self.num_blocks}
        self.builder = StepMetadataBuilder(MetadataConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_reqs=max_num_reqs, max_model_len=max_model_len,
            num_blocks=nb, window_size=cfg.window_size, compress_ratios=ratios, swa_block_size=swa_bs,
            index_topk=cfg.index_topk, form="range",
        ), dev)
        self.graphs: DecodeGraphs | None = None  # once enable_cuda_graphs() ran
        self.spec_graphs: dict[int, DecodeGraphs] = {}  # query_len q in 2..1+k -> DecodeGraphs of uniform verify steps
        self._plan: StepPlan | None = None
        self._grown: list[tuple[Hashable, int | None]] = []
        self._ran: set[int] = set()
        self._holds: list[PrefixHold] = []  # live prefix holds (at most max_cached_prefixes)
        self._step_holds: list[PrefixHold] = []  # those taken inside the open step (abort releases them)

    def _alloc_caches(self, i: int) -> LayerCaches:
        specs = {s.name: s for s in layer_cache_specs(self.cache_config, i)}
        return alloc_layer_caches(self.layers[i], specs, self.kv_cache_dtype, self.num_blocks.__getitem__,
                                  self.device, self.dtype)

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def requests(self) -> list[Hashable]:
        """Ids of the live requests."""
        return self.manager.requests

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` already in the caches (``KeyError`` if unknown)."""
        return self.manager.num_computed(request_id)

    def num_free_blocks(self, group: str | None = None) -> int:
        """Free blocks of ``group``'s pool (default: the context-sized main group)."""
        return self.manager.pools[group or self.main_group].num_free

    def cache_bytes(self) -> int:
        """Bytes of every cache tensor the engine allocated (storage, padding included)."""
        total = 0
        for c in self.caches:
            for t in (c.swa, c.compressed, c.indexer_k, c.state, c.indexer_state):
                if t is not None:
                    total += t.untyped_storage().nbytes()
        return total

    def blocks_to_reserve(self, num_tokens: int) -> int:
        """Most blocks of the main group's pool a request of ``num_tokens`` tokens ever holds
        (what a scheduler reserves when it admits one; 0 when the main group is sliding)."""
        g = next(g for g in self.manager.groups if g.name == self.main_group)
        return 0 if g.kind == "sliding" else cdiv(num_tokens, g.tokens_per_block)

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks; ``KeyError`` for an unknown id (not during a step)."""
        if self._plan is not None:
            raise RuntimeError("free() inside a step: call end_step() or abort_step() first")
        if request_id not in self.manager:
            raise KeyError(f"unknown request {request_id!r}")
        self.manager.free(request_id)

    @property
    def in_step(self) -> bool:
        return self._plan is not None

    # ---- speculative decoding ----------------------------------------------------------------
    @property
    def decode_threshold(self) -> int:
        """Requests with at most this many new tokens are decodes: ``1 + num_speculative_tokens``."""
        return 1 + self.num_speculative_tokens

    def rollback_limit(self, request_id: Hashable) -> int:
        """Tokens ``rollback`` may take back from ``request_id`` now: those computed since its
        last accepted point (a ``commit``, or the newest ``num_speculative_tokens`` tokens)."""
        if request_id not in self.manager:
            raise KeyError(f"unknown request {request_id!r}")
        return self.manager.num_computed(request_id) - self.manager.rollback_floor(request_id)

    def rollback(self, request_id: Hashable, num_tokens: int) -> int:
        """Take the last ``num_tokens`` tokens of ``request_id`` back (rejected drafts), as if
        they had never been appended; returns the blocks given back. Cost is proportional to
        what is undone: only bookkeeping changes and trailing blocks go back. Entries and state
        rows the undone tokens wrote stay in the pages but are unreadable (every read is bounded
        by the request's length) and are overwritten when those positions are appended again.

        Raises (changing nothing) RuntimeError inside a step, KeyError for an unknown id,
        TypeError/ValueError unless ``0 <= num_tokens <= rollback_limit(request_id)``."""
        if self._plan is not None:
            raise RuntimeError("rollback() inside a step: call end_step() or abort_step() first")
        limit = self.rollback_limit(request_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 0 <= num_tokens <= limit:
            raise ValueError(
                f"num_tokens must be in [0, {limit}] for request {request_id!r}: only tokens appended since its last "
                f"accepted point can be taken back (at most num_speculative_tokens={self.num_speculative_tokens} "
                f"since the last commit), got {num_tokens}")
        return self.manager.rollback(request_id, self.manager.num_computed(request_id) - num_tokens)

    def commit(self, request_id: Hashable) -> int:
        """Accept every computed token of ``request_id`` (no rollback below this point); sliding
        groups return the blocks only a rollback could have read. Returns the blocks freed."""
        if self._plan is not None:
            raise RuntimeError("commit() inside a step: call end_step() or abort_step() first")
        if request_id not in self.manager:
            raise KeyError(f"unknown request {request_id!r}")
        return self.manager.commit(request_id)

    # ---- prefix caching ----------------------------------------------------------------------
    @property
    def prefix_granule(self) -> int:
        """Prefix holds cover a multiple of this many tokens (every cache group's tokens per
        block: 256 with the default block sizes)."""
        return self.manager.prefix_granule

    @property
    def prefix_holds(self) -> list[PrefixHold]:
        """The live prefix holds, oldest first."""
        return list(self._holds)

    def save_prefix(self, request_id: Hashable, num_tokens: int) -> PrefixHold:
        """Keep what ``request_id``'s first ``num_tokens`` tokens left in the caches so that a new
        request can start there (:meth:`add_request`) without computing them: the compressed and
        indexer blocks below ``num_tokens`` and the sliding-window and compressor-state blocks a
        token at position ``num_tokens`` reads, by reference (no copy; the blocks stay out of the
        pools until the hold and every request reading them are gone).

        Between steps: ``num_tokens`` at most the request's length, and holding accepts those
        tokens (no rollback below them afterwards: under speculative decoding, save after the
        verification's rollback). Inside a step once every layer ran: up to the step's end (less
        ``num_speculative_tokens``: drafts are not verified yet); an aborted step releases the
        holds taken in it. Always a multiple of :attr:`prefix_granule` and at most a window
        behind the request's end (further back the window blocks are gone). Raises (changing
        nothing) ValueError for these, KeyError for an unknown request, and ValueError when
        ``max_cached_prefixes`` holds are live (release one first)."""
        if request_id not in self.manager:
            raise KeyError(f"unknown request {request_id!r}")
        written = None
        plan = self._plan
        if plan is not None:
            if len(self._ran) != len(self.layers):
                raise RuntimeError("save_prefix() inside a step before every layer ran: the step's rows are not "
                                   "all written yet")
            if request_id in plan.order:
                i = plan.order.index(request_id)
                written = plan.starts[i] + plan.query_lens[i]
        if len(self._holds) >= self.max_cached_prefixes:
            raise ValueError(f"{len(self._holds)} prefix holds are live, max_cached_prefixes="
                             f"{self.max_cached_prefixes}: release one (release_prefix) or raise max_cached_prefixes")
        hold = self.manager.hold_prefix(request_id, num_tokens, written)
        self._holds.append(hold)
        if plan is not None:
            self._step_holds.append(hold)
        return hold

    def release_prefix(self, hold: PrefixHold) -> int:
        """Give a prefix hold back; returns the blocks that became free (those no request reads)."""
        if not isinstance(hold, PrefixHold):
            raise TypeError(f"hold must be a PrefixHold, got {type(hold).__name__}")
        if not any(h is hold for h in self._holds):
            raise ValueError("hold is not a live prefix hold of this engine (released already, or another engine's)")
        freed = self.manager.release_prefix(hold)
        self._holds = [h for h in self._holds if h is not hold]
        return freed

    def _field_groups(self, i: int) -> dict[str, str]:
        """Layer ``i``'s cache fields (those it has) -> the group whose block ids index them."""
        specs = {sp.name: sp.group for sp in layer_cache_specs(self.cache_config, i)}
        return {f: specs[n] for f, n in CACHE_FIELD_SPECS.items() if n in specs}

    def _cache_signature(self) -> tuple:
        """What must match for another engine's pages to be read here: cache dtype, groups,
        and per layer each cache's group, entry shape, dtype and page size."""
        layers = []
        for i, (layer, c) in enumerate(zip(self.layers, self.caches)):
            tensors = {f: (g, getattr(c, f)) for f, g in self._field_groups(i).items()}
            row = [(f, g, tuple(t.shape[1:]), str(t.dtype), _page_numel(t) * t.element_size())
                   for f, (g, t) in tensors.items()]
            layers.append((layer.ratio, tuple(row)))
        groups = tuple((g.name, g.kind, g.tokens_per_block, g.window) for g in self.manager.groups)
        return (self.kv_cache_dtype, groups, tuple(layers))

    def export_prefix(self, hold: PrefixHold, device: torch.device | str = "cpu") -> PrefixBlob:
        """The cache pages a live prefix hold of this engine keeps, copied to ``device`` (see
        :class:`dsv4attn.serving.prefix_cache.PrefixBlob`). The hold stays live."""
        if not isinstance(hold, PrefixHold):
            raise TypeError(f"hold must be a PrefixHold, got {type(hold).__name__}")
        if not any(h is hold for h in self._holds):
            raise ValueError("hold is not a live prefix hold of this engine (released already, or another engine's)")
        ids = {g.name: torch.tensor([b for b in hold.block_ids(g.name) if b >= 0], dtype=torch.long,
                                    device=self.device) for g in self.manager.groups}
        pages = [{f: _pages(getattr(c, f)).index_select(0, ids[g]).to(device) for f, g in self._field_groups(i).items()}
                 for i, c in enumerate(self.caches)]
        columns = {g.name: tuple(b >= 0 for b in hold.block_ids(g.name)) for g in self.manager.groups}
        return PrefixBlob(hold.num_tokens, columns, tuple(pages), self._cache_signature())

    def import_prefix(self, blob: PrefixBlob) -> PrefixHold:
        """A prefix hold of this engine made from exported pages (fresh blocks, the pages copied
        in): start requests from it with :meth:`add_request`. Between steps; refuses (changing
        nothing) a blob of another geometry (ValueError naming what differs), a full hold count
        (ValueError) and short pools (PoolExhaustedError)."""
        if self._plan is not None:
            raise RuntimeError("import_prefix() inside a step: call end_step() or abort_step() first")
        if not isinstance(blob, PrefixBlob):
            raise TypeError(f"blob must be a PrefixBlob, got {type(blob).__name__}")
        mine = self._cache_signature()
        if blob.signature != mine:
            what = ("kv_cache_dtype" if blob.signature[0] != mine[0] else "cache groups"
                    if blob.signature[1] != mine[1] else "layers (kinds, head dims, dtypes or page sizes)")
            raise ValueError(f"blob was exported by an engine of another geometry: its {what} differ from this "
                             "engine's")
        if len(self._holds) >= self.max_cached_prefixes:
            raise ValueError(f"{len(self._holds)} prefix holds are live, max_cached_prefixes="
                             f"{self.max_cached_prefixes}: release one (release_prefix) or raise max_cached_prefixes")
        names = {g.name for g in self.manager.groups}
        if not isinstance(blob.columns, Mapping) or set(blob.columns) != names:
            raise ValueError(f"blob.columns must name exactly the groups {sorted(names)}")
        if not isinstance(blob.pages, Sequence) or len(blob.pages) != len(self.layers):
            raise ValueError(f"blob.pages must hold one entry per layer ({len(self.layers)})")
        for i, layer_pages in enumerate(blob.pages):  # shapes checked before any block is taken
            groups = self._field_groups(i)
            if not isinstance(layer_pages, Mapping) or sorted(layer_pages) != sorted(groups):
                raise ValueError(f"blob.pages[{i}] must hold the caches {sorted(groups)}")
            for f, t in layer_pages.items():
                n = sum(blob.columns[groups[f]])
                want = (n, _page_numel(getattr(self.caches[i], f)))
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != getattr(self.caches[i], f).dtype:
                    raise ValueError(f"blob.pages[{i}][{f!r}] must be a {want} tensor of the cache's dtype")
        hold = self.manager.new_prefix(blob.num_tokens, blob.columns)
        ids = {g.name: torch.tensor([b for b in hold.block_ids(g.name) if b >= 0], dtype=torch.long,
                                    device=self.device) for g in self.manager.groups}
        for i, (c, layer_pages) in enumerate(zip(self.caches, blob.pages)):
            groups = self._field_groups(i)
            for f, t in layer_pages.items():
                _pages(getattr(c, f)).index_copy_(0, ids[groups[f]], t.to(self.device))
        self._holds.append(hold)
        return hold

    def add_request(self, request_id: Hashable, prefix: PrefixHold) -> None:
        """Start ``request_id`` from a prefix hold: it has ``prefix.num_tokens`` tokens in the
        caches (the hold's, shared) and continues with ``begin_step({request_id: n})`` as a
        known request. Takes no block. Between steps only; raises (changing nothing) for a
        known or ``None`` id, a hold that is not live in this engine, or ``max_num_reqs`` live."""
        if self._plan is not None:
            raise RuntimeError("add_request() inside a step: call end_step() or abort_step() first")
        if request_id is None:
            raise ValueError("request id None is not allowed")
        if not isinstance(prefix, PrefixHold):
            raise TypeError(f"prefix must be a PrefixHold, got {type(prefix).__name__}")
        if not any(h is prefix for h in self._holds):
            raise ValueError("prefix is not a live prefix hold of this engine (released already, or another engine's)")
        if len(self.manager.requests) >= self.max_num_reqs:
            raise ValueError(f"{len(self.manager.requests)} requests are live = max_num_reqs={self.max_num_reqs}")
        if prefix.num_tokens >= self.max_model_len:
            raise ValueError(f"prefix holds {prefix.num_tokens} tokens: no room for another within "
                             f"max_model_len={self.max_model_len}")
        self.manager.add_request(request_id, prefix=prefix)

    # ---- one step ----------------------------------------------------------------------------
    def check_step(self, new_tokens: Mapping[Hashable, int]) -> dict[Hashable, int]:
        """Validate a step without changing anything; returns request -> tokens before the step.

        Raises TypeError/ValueError (bad ids, counts, limits) or PoolExhaustedError (naming the
        short group and what to set)."""
        if self._plan is not None:
            raise RuntimeError("a step is already open: call end_step() or abort_step() first")
        if not isinstance(new_tokens, Mapping):
            raise TypeError(f"new_tokens must be a dict request_id -> int, got {type(new_tokens).__name__}")
        starts: dict[Hashable, int] = {}
        total = 0
        new = 0
        demand: dict[str, int] = {g.name: 0 for g in self.manager.groups}
        for rid, n in new_tokens.items():
            if rid is None:
                raise ValueError("request id None is not allowed")
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"new_tokens[{rid!r}] must be an int, got {type(n).__name__}")
            if n < 1:
                raise ValueError(f"new_tokens[{rid!r}] is {n}: every request in a step needs >= 1 token (not empty)")
            known = rid in self.manager
            start = self.manager.num_computed(rid) if known else 0
            new += not known
            if start + n > self.max_model_len:
                raise ValueError(f"request {rid!r} would reach {start + n} tokens > max_model_len={self.max_model_len}")
            starts[rid] = start
            total += n
            for g, k in self.manager.blocks_needed_by_group(rid if known else None, start + n).items():
                demand[g] += k
        if total > self.max_num_batched_tokens:
            raise ValueError(f"step has {total} tokens > max_num_batched_tokens={self.max_num_batched_tokens}")
        if len(new_tokens) > self.max_num_reqs or len(self.manager.requests) + new > self.max_num_reqs:
            raise ValueError(f"step would hold {len(new_tokens)} requests with {len(self.manager.requests) + new} "
                             f"live > max_num_reqs={self.max_num_reqs}")
        short = self.manager.shortfall(demand)
        if short:
            name, need, pool = short[0]
            raise PoolExhaustedError(
                f"step needs {need} blocks of cache group {name!r}, only {pool.num_free} of {pool.num_blocks} free; "
                f"no request was changed. Free finished requests, or give the engine more cache: num_blocks "
                f"(now {self.num_blocks[self.main_group]} blocks of {self.main_group!r}) or memory_bytes; "
                "dsv4attn.kv_cache.accounting.memory_for_requests / max_requests size a workload")
        return starts

    def begin_step(self, new_tokens: Mapping[Hashable, int]) -> StepPlan:
        """Open a step for ``{request: new tokens}`` (new ids start at position 0, known ids
        continue). Allocates blocks and builds the step's metadata once for every layer."""
        starts = self.check_step(new_tokens)
        if not new_tokens:
            raise ValueError("new_tokens is empty: a step needs at least one request")
        grown: list[tuple[Hashable, int | None]] = []
        try:
            for rid, n in new_tokens.items():
                if rid in self.manager:
                    grown.append((rid, self.manager.num_tokens(rid)))
                    self.manager.grow(rid, starts[rid] + n)
                else:
                    self.manager.add_request(rid, starts[rid] + n)
                    grown.append((rid, None))
            plan = self._build(new_tokens, starts)
        except BaseException:
            self._undo(grown)
            raise
        self._plan, self._grown, self._ran = plan, grown, set()
        return plan

    def warmup(self, max_prefill_tokens: int = 64) -> int:
        """Run throw-away steps of every shape class serving meets, so Triton compiles each
        kernel specialisation now and none while serving: batch sizes on both sides of 16 and of
        the binary-search buckets (16, 256, 4096 requests), step token counts that are 1, a
        multiple of 16 and neither, decode-only, prefill-only and mixed steps, contexts past the
        window and the first compressed entries. Integers Triton specialises on otherwise stay
        in fixed classes (table widths rounded to 16: ``TABLE_ALIGN``). Needs an idle engine
        (no live request, no open step); leaves it as it was. ``max_prefill_tokens``: longest
        prompt chunk used (at least 17, at most ``max_num_batched_tokens``). Returns the steps
        run. With CUDA graphs enabled, decode steps of a bucket size replay (captured already)."""
        if self._plan is not None:
            raise RuntimeError("warmup() inside a step")
        if self.manager.requests:
            raise RuntimeError(f"warmup() needs an idle engine, {len(self.manager.requests)} requests are live")
        if isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be a positive int, got {max_prefill_tokens!r}")
        chunk = max(1, min(max(17, max_prefill_tokens), self.max_num_batched_tokens))
        edges = {1, 2, 3, 15, 16, 17, 255, 256, 257, 4095, 4096, 4097}
        sizes = sorted(r for r in edges if r <= min(self.max_num_reqs, self.max_num_batched_tokens))
        hidden = {}
        steps = 0

        def run(feed: dict) -> None:
            nonlocal steps
            plan = self.begin_step(feed)
            try:
                n = plan.num_tokens
                if n not in hidden:
                    hidden[n] = torch.zeros(n, self.layers[0].config.hidden_size, dtype=self.dtype, device=self.device)
                for i in range(len(self.layers)):
                    self.run_layer(i, hidden[n])
            except BaseException:
                self.abort_step()
                raise
            self.end_step()
            steps += 1

        budget, room = self.max_num_batched_tokens, self.max_model_len
        for R in sizes:
            ids = [("warmup", R, j) for j in range(R)]
            try:
                # step token counts of each class next to R: R itself, the next multiple of 16
                # above R, and one more (as extra tokens of request 0)
                up = (R // 16 + 1) * 16
                extras = (0, up - R, up - R + 1)
                for extra in extras:  # prefill-only steps of R new requests
                    if R + extra <= budget and 1 + extra <= min(chunk, room):
                        run({rid: 1 + extra * (j == 0) for j, rid in enumerate(ids)})
                        for rid in ids:
                            self.free(rid)
                # contexts past the window and the first compressed entries (one long, the rest short)
                run({ids[0]: max(1, min(chunk, room - 2 * up))})
                per = max(1, budget // 9)
                for k in range(1, R, per):
                    run({rid: max(1, min(9, room - 2 * up)) for rid in ids[k:k + per]})
                # decode-only (every request one token) and mixed steps (request 0 a chunk)
                for extra in extras:
                    feed = {rid: 1 + extra * (j == 0) for j, rid in enumerate(ids)}
                    if R + extra <= budget and 1 + extra <= chunk and all(
                            self.seq_len(r) + n <= room for r, n in feed.items()):
                        run(feed)
            except PoolExhaustedError:
                break  # no room for R requests: larger batches do not fit either
            finally:
                for rid in ids:
                    if rid in self.manager:
                        self.free(rid)
        return steps

    def enable_cuda_graphs(self, buckets: Sequence[int] | None = None, capture: bool = True) -> None:
        """Serve decode-only steps (every request one new token) through CUDA graphs captured per
        batch-size bucket (see :mod:`dsv4attn.serving.graphs`); ``capture=False`` runs the same
        padded static steps eagerly. Other steps stay eager. With ``num_speculative_tokens = k``
        verify steps where every request feeds the same q in 2..1+k tokens get graphs too."""
        from dsv4attn.serving.graphs import DecodeGraphs

        if self._plan is not None:
            raise RuntimeError("enable_cuda_graphs() inside a step")
        if capture and self.device.type == "cuda" and self.dtype != torch.bfloat16:
            # fp32 layers run attention through the op's reference path (the Triton kernel
            # multiplies in bf16), which reads each set's longest row on the host: not capturable.
            raise ValueError(f"CUDA graphs need bf16 layers (the Triton attention path); these layers are "
                             f"{self.dtype}: run them eagerly, or with enable_cuda_graphs(capture=False)")
        self.graphs = DecodeGraphs(self, buckets, capture)
        self.spec_graphs = {q: DecodeGraphs(self, buckets, capture, query_len=q)
                            for q in range(2, self.decode_threshold + 1) if self.max_num_batched_tokens >= q}

    def _graphs_for(self, qlens: Sequence[int]) -> DecodeGraphs | None:
        """The DecodeGraphs serving a step whose requests all feed the same count (else None)."""
        if self.graphs is None or not qlens or any(q != qlens[0] for q in qlens):
            return None
        return self.graphs if qlens[0] == 1 else self.spec_graphs.get(qlens[0])

    def _build(self, new_tokens: Mapping[Hashable, int], starts: Mapping[Hashable, int]) -> StepPlan:
        thr = self.decode_threshold
        order = sorted(new_tokens, key=lambda rid: new_tokens[rid] > thr)  # decodes first (stable)
        qlens = [new_tokens[rid] for rid in order]
        seq_lens = [starts[rid] + n for rid, n in zip(order, qlens)]
        dev, m = self.device, self.manager
        graphs = self._graphs_for(qlens)
        bucket = graphs.bucket_for(len(order)) if graphs is not None else None
        if graphs is not None and bucket is not None:  # a bucket comes from graphs only
            meta = graphs.prepare(order, seq_lens, bucket)
            gtables, gpos = {}, {}
            for r in _STATE_GROUP:
                t, sp = graphs.state_table(bucket, r), graphs.state_positions(bucket, r)
                if t is not None and sp is not None:
                    gtables[r], gpos[r] = t, sp
            return StepPlan(tuple(order), tuple(qlens), tuple(starts[rid] for rid in order), meta, gtables, bucket,
                            gpos)
        tables = {g: m.block_table(order, g, device=dev, align=TABLE_ALIGN) for g in (GROUP_SWA, GROUP_FULL_MLA)
                  if g in self.num_blocks}
        batch = BatchMetadata.from_requests(qlens, seq_lens, tables, swa_block_size=self.cache_config.swa_block_size,
                                            num_speculative_tokens=self.num_speculative_tokens, device=dev)
        meta = self.builder.build(batch, impl=self.impl)
        # windowed state tables: a row holds the columns from the step's earliest state row on,
        # and the state ops see positions relative to it (width follows the window, not the context)
        state_tables, state_positions = {}, {}
        for r, g in _STATE_GROUP.items():
            if g not in self.num_blocks:
                continue
            firsts, shift = state_window([starts[rid] for rid in order], qlens, r, self._tokens_per_block[g])
            state_tables[r] = m.block_table(order, g, device=dev, first_cols=firsts, align=TABLE_ALIGN)
            state_positions[r] = (batch.positions_cpu - shift).to(dev)
        return StepPlan(tuple(order), tuple(qlens), tuple(starts[rid] for rid in order), meta, state_tables,
                        None, state_positions)

    def run_layer(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention for the open step: hidden ``[T, hidden_size]`` (rows in
        ``plan.order``, the layer's dtype, on the engine's device) -> ``[T, hidden_size]``."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("run_layer() outside a step: call begin_step() first")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.layers):
            raise ValueError(f"layer index must be in [0, {len(self.layers)}), got {i!r}")
        if i in self._ran:
            raise RuntimeError(f"layer {i} already ran in this step (its caches hold the step's tokens)")
        hs = self.layers[i].config.hidden_size
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if tuple(hidden.shape) != (plan.num_tokens, hs) or hidden.dtype != self.dtype or hidden.device != self.device:
            raise ValueError(f"hidden must be [{plan.num_tokens}, {hs}] {self.dtype} on {self.device}, got "
                             f"{tuple(hidden.shape)} {hidden.dtype} on {hidden.device}")
        self._ran.add(i)
        return self._run_layer(i, hidden, plan)

    def _run_layer(self, i: int, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Layer ``i`` on validated input (dsv4attn.distributed's DCP engine overrides it)."""
        layer = self.layers[i]
        if plan.bucket is not None:
            graphs = self._graphs_for(plan.query_lens)
            assert graphs is not None  # _build gave the plan a bucket from these same graphs
            return graphs.run(i, hidden, plan.bucket)
        with torch.no_grad():
            st, sp = plan.state(layer.ratio)
            return layer_step(layer, hidden, plan.metadata, self.builder, self.caches[i], st, impl=self.impl,
                              deterministic=self.deterministic, state_positions=sp, tables=plan.tables)

    def end_step(self) -> StepPlan:
        """Close the step: its tokens count as computed (sliding groups release blocks)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("end_step() without begin_step()")
        for rid, s, n in zip(plan.order, plan.starts, plan.query_lens):
            self.manager.advance(rid, s + n)
        self._plan, self._grown, self._step_holds = None, [], []
        return plan

    def abort_step(self) -> None:
        """Drop the open step: its blocks go back, new requests are forgotten. Layers that
        already ran wrote the step's positions, which later steps overwrite before reading."""
        if self._plan is None:
            raise RuntimeError("abort_step() without begin_step()")
        for hold in self._step_holds:  # they hold rows of tokens that are now not computed
            if not hold.released:
                self.release_prefix(hold)
        self._undo(self._grown)
        self._plan, self._grown, self._step_holds = None, [], []

    def _undo(self, grown: list[tuple[Hashable, int | None]]) -> None:
        for rid, before in reversed(grown):
            if before is None:
                self.manager.free(rid)
            else:
                self.manager.truncate(rid, before)
