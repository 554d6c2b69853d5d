"""Block allocation: one shared pool of block ids, one block table per (request, group).

Block ids come from a single :class:`BlockPool` shared by every group, so caches of different
groups that share a physical tensor (vLLM's page-size sharing, dsv4-system.md 3.3) never see the
same id twice. Column ``c`` of a request's table in a group covers raw positions
``[c * tokens_per_block, (c + 1) * tokens_per_block)``; entry ``e`` of a cache with ``block_size``
stored entries per block is at column ``e // block_size``.

- Full groups grow with the sequence: ``cdiv(num_tokens, tokens_per_block)`` columns.
- Sliding groups (window ``W`` raw positions) free the columns no future token can read: after
  ``num_computed`` tokens, the next token (position ``num_computed``) reads positions
  ``>= num_computed - W + 1``, so columns entirely below that are returned to the pool. Freed
  columns keep their place and hold :data:`NULL_BLOCK` (-1), so column indices never shift.

Every mutating call either succeeds completely or raises and changes nothing
(:class:`PoolExhaustedError` when the pool is short; the check covers all groups at once).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from dsv4attn.kv_cache.specs import GroupSpec

#: Block id stored in freed or never-filled table columns (and in padding of exported tables).
NULL_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolExhaustedError(RuntimeError):
    """Raised when a request needs more blocks than the pool has free; nothing was changed."""


class BlockPool:
    """A free list of block ids ``0 .. num_blocks-1`` shared by all groups."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Pop from the end: low ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Remove and return ``n`` free ids; raises (changing nothing) if fewer are free."""
        if n > len(self._free):
            raise PoolExhaustedError(f"need {n} blocks, only {len(self._free)} of {self.num_blocks} free")
        if n == 0:
            return []
        ids = self._free[-n:][::-1]
        del self._free[-n:]
        return ids

    def give_back(self, ids: Sequence[int]) -> None:
        self._free.extend(reversed(list(ids)))


class KVCacheManager:
    """Per-request block tables for every group of a model, over one :class:`BlockPool`.

    ``groups``: the allocation groups (e.g. ``cache_groups(cfg)``). Requests are keyed by any
    hashable id. State per request and group: a list of block ids (``NULL_BLOCK`` where freed),
    the number of tokens allocated for and the number of tokens computed.
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int) -> None:
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        for g in groups:
            if g.kind == "sliding" and (g.window is None or g.window <= 0):
                raise ValueError(f"sliding group {g.name!r} needs a positive window, got {g.window}")
        self.groups = list(groups)
        self.pool = BlockPool(num_blocks)
        self._tables: dict[Hashable, dict[str, list[int]]] = {}
        self._num_tokens: dict[Hashable, int] = {}
        self._num_computed: dict[Hashable, int] = {}

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._tables

    @property
    def requests(self) -> list[Hashable]:
        return list(self._tables)

    def num_tokens(self, req_id: Hashable) -> int:
        return self._num_tokens[self._check(req_id)]

    def num_computed(self, req_id: Hashable) -> int:
        return self._num_computed[self._check(req_id)]

    def block_ids(self, req_id: Hashable, group: str) -> list[int]:
        """A copy of the request's table in ``group`` (``NULL_BLOCK`` in freed columns)."""
        return list(self._tables[self._check(req_id)][self._group(group).name])

    def num_held(self, req_id: Hashable, group: str | None = None) -> int:
        """Blocks the request holds (in one group, or in all)."""
        tables = self._tables[self._check(req_id)]
        names = [self._group(group).name] if group is not None else list(tables)
        return sum(1 for n in names for b in tables[n] if b != NULL_BLOCK)

    def blocks_needed(self, req_id: Hashable | None, num_tokens: int) -> int:
        """Blocks a grow to ``num_tokens`` would take from the pool (``None``: a new request)."""
        have = self._tables.get(req_id) if req_id is not None else None
        total = 0
        for g in self.groups:
            cur = len(have[g.name]) if have is not None else 0
            lo = self._first_live_col(g, self._num_computed.get(req_id, 0)) if have is not None else 0
            total += max(0, cdiv(num_tokens, g.tokens_per_block) - max(cur, lo))
        return total

    # ---- mutations ---------------------------------------------------------------------
    def add_request(self, req_id: Hashable, num_tokens: int = 0) -> None:
        """Register ``req_id`` and allocate for its first ``num_tokens`` tokens (all or nothing)."""
        if req_id in self._tables:
            raise ValueError(f"request {req_id!r} already exists")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need = self.blocks_needed(None, num_tokens)
        if need > self.pool.num_free:
            raise PoolExhaustedError(
                f"request {req_id!r} needs {need} blocks for {num_tokens} tokens, "
                f"only {self.pool.num_free} of {self.pool.num_blocks} free"
            )
        self._tables[req_id] = {g.name: [] for g in self.groups}
        self._num_tokens[req_id] = 0
        self._num_computed[req_id] = 0
        self.grow(req_id, num_tokens)

    def grow(self, req_id: Hashable, num_tokens: int) -> None:
        """Make every group cover raw positions ``0 .. num_tokens-1`` (sliding groups: only the
        still-visible ones). Shrinking is not allowed; raises :class:`PoolExhaustedError`
        without changing anything when the pool is short."""
        self._check(req_id)
        if num_tokens < self._num_tokens[req_id]:
            raise ValueError(f"num_tokens {num_tokens} < current {self._num_tokens[req_id]} for {req_id!r}")
        need = self.blocks_needed(req_id, num_tokens)
        if need > self.pool.num_free:
            raise PoolExhaustedError(
                f"request {req_id!r} needs {need} more blocks to reach {num_tokens} tokens, "
                f"only {self.pool.num_free} of {self.pool.num_blocks} free"
            )
        ids = iter(self.pool.take(need))
        tables = self._tables[req_id]
        for g in self.groups:
            table = tables[g.name]
            want = cdiv(num_tokens, g.tokens_per_block)
            lo = self._first_live_col(g, self._num_computed[req_id])
            while len(table) < want:
                table.append(next(ids) if len(table) >= lo else NULL_BLOCK)
        assert next(ids, None) is None
        self._num_tokens[req_id] = num_tokens

    def advance(self, req_id: Hashable, num_computed: int) -> int:
        """Record that tokens ``0 .. num_computed-1`` are in the caches; sliding groups return
        the blocks no later token can read. Returns the number of blocks freed."""
        self._check(req_id)
        if not self._num_computed[req_id] <= num_computed <= self._num_tokens[req_id]:
            raise ValueError(
                f"num_computed must be in [{self._num_computed[req_id]}, {self._num_tokens[req_id]}] "
                f"for {req_id!r}, got {num_computed}"
            )
        self._num_computed[req_id] = num_computed
        freed: list[int] = []
        for g in self.groups:
            table = self._tables[req_id][g.name]
            for c in range(min(self._first_live_col(g, num_computed), len(table))):
                if table[c] != NULL_BLOCK:
                    freed.append(table[c])
                    table[c] = NULL_BLOCK
        self.pool.give_back(freed)
        return len(freed)

    def free(self, req_id: Hashable) -> int:
        """Forget ``req_id`` and return all its blocks to the pool; returns how many."""
        tables = self._tables.pop(self._check(req_id))
        del self._num_tokens[req_id], self._num_computed[req_id]
        ids = [b for t in tables.values() for b in t if b != NULL_BLOCK]
        self.pool.give_back(ids)
        return len(ids)

    # ---- export ---------------------------------------------------------------------------
    def block_table(self, req_ids: Sequence[Hashable], group: str, width: int | None = None,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """``[len(req_ids), width]`` int32 block table of ``group`` (rows in ``req_ids`` order),
        padded with ``NULL_BLOCK``. ``width`` defaults to the longest row; a fixed capacity width
        keeps the tensor shape stable for CUDA graphs. Raises if a row does not fit."""
        g = self._group(group)
        rows = [self._tables[self._check(r)][g.name] for r in req_ids]
        longest = max((len(r) for r in rows), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width {width} < longest {g.name} block table ({longest} columns)")
        out = torch.full((len(rows), width), NULL_BLOCK, dtype=torch.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return out.to(device)

    # ---- helpers --------------------------------------------------------------------------
    @staticmethod
    def _first_live_col(g: GroupSpec, num_computed: int) -> int:
        """First column a future token may read (0 for full groups)."""
        if g.kind == "full":
            return 0
        first_visible = max(0, num_computed - g.window + 1)
        return first_visible // g.tokens_per_block

    def _group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"unknown group {name!r}; groups are {[g.name for g in self.groups]}")

    def _check(self, req_id: Hashable) -> Hashable:
        if req_id not in self._tables:
            raise KeyError(f"unknown request {req_id!r}")
        return req_id


def sliding_blocks_bound(group: GroupSpec, step_tokens: int) -> int:
    """Most blocks a request holds in a sliding group after ``advance`` to its computed length
    and a grow of ``step_tokens`` new tokens: ``cdiv(W - 1 + step_tokens, bs) + 1``."""
    assert group.kind == "sliding" and group.window is not None
    return cdiv(group.window - 1 + step_tokens, group.tokens_per_block) + 1
