"""Decode steps in CUDA graphs: per batch-size bucket, padded, captured once, replayed at any context.

``DecodeGraphs(engine, buckets)`` holds the static inputs every captured layer step reads:

- block tables of every group at their capacity width ``cdiv(max_model_len, tokens_per_block)``
  (rows = bucket size), positions and SWA slot mapping ``[bucket]``; a step rewrites only the
  columns its rows reach now or reached before (the rest stay ``NULL_BLOCK``), so the host work
  and the copy follow the batch's real context, not ``max_model_len``;
- the metadata builder's persistent buffers (already static: ``StepMetadataBuilder``);
- one hidden-state input ``[bucket, hidden]`` per bucket.

A decode-only step of R requests (R <= the largest bucket) is padded to the smallest bucket
B >= R with pad requests (one token at position 0, SWA slot -1, every other table row -1: the
writers skip them and their candidate sets are empty). ``prepare`` writes the step's tables,
positions and slots into the static buffers and runs the metadata builder on them (host work,
once per step); ``run(i, hidden)`` copies hidden into the bucket's input and replays layer i's
graph. Every captured shape depends on B and the table capacities only (the layer step has no
shape that depends on a context length and no host sync), so a graph captured at a short
context replays correctly at any longer one.

``capture=False`` runs the same padded static step eagerly (CPU-testable, and the "eager"
side of the bit-for-bit replay tests).

Speculative decoding: ``query_len = q > 1`` makes the same structure for verify steps in which
every request feeds q tokens (the last accepted token and q - 1 drafts): buckets count
requests, the static inputs hold ``bucket * q`` token rows, and pad requests feed q tokens at
positions ``0 .. q-1`` with SWA slot -1 (zero-length candidate sets), no state blocks, and
compressed slots -1 (cleared after the build): they write nothing. The engine keeps one
instance per q in ``2 .. 1 + k``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import torch

from dsv4attn.kv_cache.allocator import NULL_BLOCK, cdiv
from dsv4attn.kv_cache.specs import GROUP_C4_STATE, GROUP_C128_STATE, GROUP_FULL_MLA, GROUP_SWA
from dsv4attn.metadata import BatchMetadata, StepMetadata
from dsv4attn.serving.paged import StepTables, layer_step, state_window

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_STATE = {4: GROUP_C4_STATE, 128: GROUP_C128_STATE}
_RATIO = {name: r for r, name in _STATE.items()}


class DecodeGraphs:
    """Static buffers and (optionally) captured graphs of padded decode steps for one engine."""

    def __init__(self, engine, buckets: Sequence[int] | None = None, capture: bool = True,
                 query_len: int = 1) -> None:
        q = query_len
        if isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= engine.decode_threshold:
            raise ValueError(f"query_len must be an int in [1, decode_threshold={engine.decode_threshold}], got "
                             f"{query_len!r}")
        self.query_len = q
        cap = min(engine.max_num_reqs, engine.max_num_batched_tokens // q)
        buckets = sorted({b for b in (buckets or DEFAULT_BUCKETS) if isinstance(b, int) and 1 <= b <= cap})
        if not buckets:
            raise ValueError(f"no decode bucket in [1, min(max_num_reqs, max_num_batched_tokens // {q}) = {cap}]")
        if capture and engine.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {engine.device}")
        self.engine, self.buckets, self.capture = engine, tuple(buckets), capture
        dev, n, L = engine.device, buckets[-1], engine.max_model_len
        self.groups = {g.name: g for g in engine.manager.groups}
        self.tables = {name: torch.full((n, self._width(g, L, q)), NULL_BLOCK, dtype=torch.int32, device=dev)
                       for name, g in self.groups.items()}
        # positions the state ops see in the windowed state tables (see layer_step)
        self.state_pos = {name: torch.zeros(n * q, dtype=torch.int64, device=dev) for name in self.tables
                          if name in _RATIO}
        # their host-side images, rewritten each step (one allocation, not one per step)
        self._host = {name: torch.full(t.shape, NULL_BLOCK, dtype=torch.int32) for name, t in self.tables.items()}
        # per group and row: columns that may hold a block id (past them the row is NULL_BLOCK on
        # host and device), so a step rewrites and copies only the columns its requests (or the
        # previous occupants of its rows) reach, not the capacity width sized by max_model_len
        self._dirty = {name: [0] * n for name in self.tables}
        self.positions = torch.zeros(n * q, dtype=torch.int64, device=dev)
        self.slots = torch.full((n * q, ), -1, dtype=torch.int64, device=dev)
        hs = engine.layers[0].config.hidden_size
        self.inputs = {b: torch.zeros(b * q, hs, dtype=engine.dtype, device=dev) for b in buckets}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.steps: dict[int, StepMetadata] = {}
        # per bucket: the values its layers share (rotary tables, pooling positions), read by the
        # captured graphs and recomputed in place by each prepare
        self.shared = {b: StepTables() for b in buckets}
        self._pool: torch.cuda._POOL_HANDLE | None = None  # the first capture's memory pool, shared
        for b in self.buckets:
            self.prepare([], [], b)  # all-pad step: builds the bucket's static metadata
            if capture:
                self._capture(b)

    @staticmethod
    def _width(g, max_model_len: int, q: int) -> int:
        """Columns of a group's static table: the capacity ``cdiv(max_model_len, tokens_per_block)``;
        a state group's table is windowed (``serving.paged.state_window_base``), so a decode step of q tokens
        needs at most ``cdiv(2r + lcm(r, tokens_per_block) + q, tokens_per_block) + 1``."""
        full = cdiv(max_model_len, g.tokens_per_block)
        r = _RATIO.get(g.name)
        if r is None:
            return full
        return min(full, cdiv(2 * r + math.lcm(r, g.tokens_per_block) + q, g.tokens_per_block) + 1)

    def bucket_for(self, num_reqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_reqs), None)

    # ---- per step ----------------------------------------------------------------------------
    def prepare(self, order: Sequence[Hashable], seq_lens: Sequence[int], bucket: int) -> StepMetadata:
        """Write a decode step (``order`` requests, ``query_len`` new tokens each, ``seq_lens``
        after it) padded to ``bucket`` into the static buffers and build its metadata."""
        eng, m, R, q = self.engine, self.engine.manager, len(order), self.query_len
        swa_bs = eng.cache_config.swa_block_size
        pos = torch.arange(q, dtype=torch.int64).repeat(bucket)  # pad requests: positions 0 .. q-1
        slots = torch.full((bucket * q,), -1, dtype=torch.int64)
        p = torch.tensor(list(seq_lens), dtype=torch.int64)[:, None] - q + torch.arange(q)[None, :]  # [R, q]
        pos[:R * q] = p.flatten()
        for name, t in self.tables.items():
            tpb = self.groups[name].tokens_per_block
            pad_w = 1 if name == GROUP_SWA or (name == GROUP_FULL_MLA and q > 1) else 0
            ratio = _RATIO.get(name)
            firsts = [0] * R
            if ratio is not None:  # windowed state table; pad tokens keep shift 0
                firsts, shift = state_window([sl - q for sl in seq_lens], [q] * R, ratio, tpb)
                sp = pos.clone()
                sp[:R * q] -= shift
                self.state_pos[name][:bucket * q].copy_(sp)
            # row lengths: a decode step grew every table to its request's seq_len
            rows = [cdiv(n, tpb) - f for n, f in zip(seq_lens, firsts)] + [pad_w] * (bucket - R)
            dirty = self._dirty[name]
            w = min(t.shape[1], max(max(rows), max(dirty[:bucket])))  # columns to rewrite this step
            dirty[:bucket] = rows
            if w == 0:
                continue  # every row of the bucket is NULL_BLOCK already, on host and device
            host = self._host[name][:bucket, :w]  # persistent host buffer: no per-step allocation
            if R:  # NULL_BLOCK past each row's live columns; state groups windowed
                m.block_table(order, name, out=host[:R], first_cols=firsts if ratio is not None else None)
            host[R:].fill_(NULL_BLOCK)
            if name == GROUP_SWA and R:
                # the new tokens' SWA slots, all requests at once
                blk = host[torch.arange(R)[:, None], p // swa_bs].to(torch.int64)
                slots[:R * q] = (blk * swa_bs + p % swa_bs).flatten()
            if name == GROUP_SWA or (name == GROUP_FULL_MLA and q > 1):
                # SWA pad rows: a valid id in the one column position 0 maps to (never read); full
                # pad rows when q > 1 reach entry 0 (p = 3): an id for the builder's check, their
                # compressed slots are cleared below, so nothing is written
                host[R:, 0] = 0
            t[:bucket, :w].copy_(host)
        self.positions[:bucket * q].copy_(pos)
        self.slots[:bucket * q].copy_(slots)
        tables = {g: self.tables[g][:bucket] for g in (GROUP_SWA, GROUP_FULL_MLA) if g in self.tables}
        batch = BatchMetadata.from_requests([q] * bucket, list(seq_lens) + [q] * (bucket - R), tables,
                                            slot_mapping=self.slots[:bucket * q], device=eng.device,
                                            num_speculative_tokens=eng.num_speculative_tokens)
        batch = dataclasses.replace(batch, positions=self.positions[:bucket * q])
        meta = eng.builder.build(batch, impl=eng.impl)
        if q > 1:
            for cm in meta.compressed.values():
                cm.slot_mapping[R * q:].fill_(-1)
        self.steps[bucket] = meta
        self.shared[bucket].refresh()
        return meta

    def state_table(self, bucket: int, ratio: int) -> torch.Tensor | None:
        name = _STATE.get(ratio)
        return self.tables[name][:bucket] if name in self.tables else None

    def state_positions(self, bucket: int, ratio: int) -> torch.Tensor | None:
        name = _STATE.get(ratio)
        return self.state_pos[name][:bucket * self.query_len] if name in self.state_pos else None

    def _eager(self, i: int, bucket: int, hidden: torch.Tensor) -> torch.Tensor:
        eng = self.engine
        layer = eng.layers[i]
        return layer_step(layer, hidden, self.steps[bucket], eng.builder, eng.caches[i],
                          self.state_table(bucket, layer.ratio), impl=eng.impl, deterministic=eng.deterministic,
                          state_positions=self.state_positions(bucket, layer.ratio), tables=self.shared[bucket])

    def run(self, i: int, hidden: torch.Tensor, bucket: int) -> torch.Tensor:
        """Layer i on the prepared step: hidden ``[R * query_len, hidden]`` -> same shape (a copy)."""
        R = hidden.shape[0]
        x = self.inputs[bucket]
        x[:R].copy_(hidden)
        if self.capture:
            self.graphs[(i, bucket)].replay()
            out = self.outputs[(i, bucket)]
        else:
            with torch.no_grad():
                out = self._eager(i, bucket, x)
        return out[:R].clone()

    # ---- capture -----------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, bucket: int) -> None:
        eng = self.engine
        x = self.inputs[bucket]
        stream = torch.cuda.Stream(eng.device)
        stream.wait_stream(torch.cuda.current_stream(eng.device))
        with torch.cuda.stream(stream):
            for i in range(len(eng.layers)):  # warm-up: compiles every kernel of the static form
                self._eager(i, bucket, x)
        torch.cuda.current_stream(eng.device).wait_stream(stream)
        torch.cuda.synchronize(eng.device)
        for i in range(len(eng.layers)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                self.outputs[(i, bucket)] = self._eager(i, bucket, x)
            self._pool = g.pool()
            self.graphs[(i, bucket)] = g
