"""Block allocation: block-id pools and one block table per (request, group).

Column ``c`` of a request's table in a group covers raw positions ``[c * tokens_per_block,
(c + 1) * tokens_per_block)``; entry ``e`` of a cache with ``block_size`` stored entries per
block is at column ``e // block_size``.

Pools: ``KVCacheManager(groups, num_blocks)`` with an int draws every group's ids from ONE
shared :class:`BlockPool` (caches of different groups that share a physical tensor never see
the same id twice, dsv4-system.md 3.3); with a mapping ``group -> count`` every group has its
own pool, sized by its own geometry ("memory by need": sliding groups bounded by their window,
the full group by the context; see :mod:`dsv4attn.kv_cache.accounting` for the sizing).

- Full groups grow with the sequence: ``cdiv(num_tokens, tokens_per_block)`` columns.
- Sliding groups (window ``W`` raw positions) free the columns no future token can read: after
  ``num_computed`` tokens, the next token (position ``num_computed``) reads positions
  ``>= num_computed - W + 1``, so columns entirely below that are returned to the pool. Freed
  columns keep their place and hold :data:`NULL_BLOCK` (-1), so column indices never shift.

Speculative decoding (``rollback_tokens = k > 0``): tokens may be taken back after they were
computed (:meth:`KVCacheManager.rollback`), so sliding groups keep every column a token at the
request's *rollback floor* could read, not only what the next token reads. The floor is the
highest ``num_computed - k`` seen (never lowered) or a later :meth:`KVCacheManager.commit`
point; a request can roll back to any length ``>= floor``. With ``k = 0`` the floor is
``num_computed`` and nothing changes.

Prefix holds (:meth:`KVCacheManager.hold_prefix`): a request's blocks can be kept by reference
at a length that is a multiple of every group's tokens per block, and a new request can start
from such a hold, sharing those blocks (prefix caching). Pools count references per block; a
block is free again when its last owner (request or hold) gives it back. Shared blocks are never
written: a request only writes positions at or past its start, which lie in later columns.

Every mutating call either succeeds completely or raises and changes nothing
(:class:`PoolExhaustedError` when a pool is short; the check covers all groups at once). Pools
refuse negative counts, ids they did not hand out and a give-back of an id already free.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
import math
from itertools import chain

import torch

from dsv4attn.kv_cache.specs import GroupSpec

#: Block id stored in freed or never-filled table columns (and in padding of exported tables).
NULL_BLOCK = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _count(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return v


class PoolExhaustedError(RuntimeError):
    """Raised when a request needs more blocks than a pool has free; nothing was changed."""


class BlockPool:
    """A free list of block ids ``0 .. num_blocks-1`` with a reference count per handed-out id.

    :meth:`take` hands ids out with one reference; :meth:`share` adds one to ids already out
    (a block read by several owners: a request and the prefix holds that keep its pages);
    :meth:`give_back` drops one, and an id returns to the free list when its last reference goes.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _count("num_blocks", num_blocks)
        # Pop from the end: low ids are handed out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}  # handed-out id -> references

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, block: int) -> int:
        """References to ``block`` (0 when it is free)."""
        return self._refs.get(block, 0)

    def take(self, n: int) -> list[int]:
        """Remove and return ``n`` free ids; raises (changing nothing) if fewer are free."""
        _count("n", n)
        if n > len(self._free):
            raise PoolExhaustedError(f"need {n} blocks, only {len(self._free)} of {self.num_blocks} free")
        if n == 0:
            return []
        ids = self._free[-n:][::-1]
        del self._free[-n:]
        self._refs.update(dict.fromkeys(ids, 1))
        return ids

    def _check_out(self, ids: list[int], verb: str) -> None:
        """Refuse (changing nothing) ids this pool has not handed out and duplicates in ``ids``."""
        seen: set[int] = set()
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int):
                raise TypeError(f"block ids must be ints, got {type(b).__name__}")
            if b in seen or b not in self._refs:
                what = ("given twice" if b in seen else "not handed out (free or given back already)"
                        if 0 <= b < self.num_blocks else "not a block id of this pool")
                raise ValueError(f"block id {b} {what} (pool of {self.num_blocks}); nothing was {verb}")
            seen.add(b)

    def share(self, ids: Sequence[int]) -> None:
        """One more reference to each of ``ids`` (all handed out; no duplicates)."""
        ids = list(ids)
        self._check_out(ids, "shared")
        for b in ids:
            self._refs[b] += 1

    def give_back(self, ids: Sequence[int]) -> None:
        """Drop one reference to each of ``ids``; an id whose last reference goes is free again.
        Refuses (changing nothing) ids this pool never handed out, ids already free and
        duplicates within ``ids``."""
        ids = list(ids)
        self._check_out(ids, "returned")
        freed = []
        for b in ids:
            if self._refs[b] == 1:
                del self._refs[b]
                freed.append(b)
            else:
                self._refs[b] -= 1
        self._free.extend(reversed(freed))


class PrefixHold:
    """The blocks a request needs to continue from ``num_tokens`` tokens, kept by reference
    (see :meth:`KVCacheManager.hold_prefix`): every full-group column below ``num_tokens`` and the
    sliding columns a token at position ``num_tokens`` can read. Opaque to callers: start a
    request from it with ``add_request(..., prefix=hold)``; give it back with ``release_prefix``."""

    __slots__ = ("_owner", "num_tokens", "_tables", "_live")

    def __init__(self, owner: KVCacheManager, num_tokens: int, tables: dict[str, tuple[int, ...]]) -> None:
        self._owner, self.num_tokens, self._tables, self._live = owner, num_tokens, tables, True

    @property
    def released(self) -> bool:
        return not self._live

    @property
    def num_blocks(self) -> int:
        """Blocks this hold keeps a reference to (all groups)."""
        return sum(1 for t in self._tables.values() for b in t if b != NULL_BLOCK)

    def block_ids(self, group: str) -> list[int]:
        """The hold's table in ``group`` (``NULL_BLOCK`` below the columns it keeps)."""
        return list(self._tables[group])

    def __repr__(self) -> str:
        return f"PrefixHold(num_tokens={self.num_tokens}, blocks={self.num_blocks}, released={not self._live})"


class KVCacheManager:
    """Per-request block tables for every group of a model.

    ``groups``: the allocation groups (e.g. ``cache_groups(cfg)``); ``num_blocks``: an int (one
    pool shared by all groups) or ``{group name: blocks}`` (one pool per group, every group
    named). Requests are keyed by any hashable id except ``None``. State per request and group:
    a list of block ids (``NULL_BLOCK`` where freed), tokens allocated for, tokens computed, and
    the rollback floor. ``rollback_tokens``: how many computed tokens a request may take back
    since its last commit (speculative decoding; see the module docstring).
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int | Mapping[str, int],
                 rollback_tokens: int = 0) -> None:
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        for g in groups:
            if g.kind == "sliding" and (g.window is None or g.window <= 0):
                raise ValueError(f"sliding group {g.name!r} needs a positive window, got {g.window}")
        self.groups = list(groups)
        if isinstance(num_blocks, Mapping):
            if set(num_blocks) != set(names):
                raise ValueError(f"num_blocks must name exactly the groups {names}, got {sorted(num_blocks)}")
            self.pools = {n: BlockPool(_count(f"num_blocks[{n!r}]", num_blocks[n])) for n in names}
            self._shared: BlockPool | None = None
        else:
            self._shared = BlockPool(_count("num_blocks", num_blocks))
            self.pools = {n: self._shared for n in names}
        self._tables: dict[Hashable, dict[str, list[int]]] = {}
        self._num_tokens: dict[Hashable, int] = {}
        self._num_computed: dict[Hashable, int] = {}
        self._reclaimed: dict[Hashable, dict[str, int]] = {}  # columns below are already NULL_BLOCK
        self.rollback_tokens = _count("rollback_tokens", rollback_tokens)
        self._floor: dict[Hashable, int] = {}  # lowest length a rollback may reach (sliding reclaim follows it)
        # Per-request answers to the two questions every decode step asks of every request,
        # kept in step with the tables (add_request / grow / truncate / _reclaim / free):
        self._cover: dict[Hashable, int] = {}  # tokens every group's table has a column for
        self._reclaim_at: dict[Hashable, int] = {}  # lowest floor at which a sliding column falls out
        # Export images of the full groups (whose rows are all live): one int32 host tensor per
        # group with a row per live request (its table, NULL_BLOCK past its end), written where
        # a table grows or shrinks, so block_table() gathers rows instead of rebuilding them
        # from the lists every step. Sliding groups keep a few live columns of a wide row and
        # are written from their live columns instead (cheaper than gathering the wide rows).
        self._img: dict[str, torch.Tensor] = {g.name: torch.full((0, 0), NULL_BLOCK, dtype=torch.int32)
                                              for g in self.groups if g.kind == "full"}
        self._row: dict[Hashable, int] = {}
        self._free_rows: list[int] = []
        self._rows_used = 0
        self._holds: dict[int, PrefixHold] = {}  # the live PrefixHolds of this manager, by id()

    @property
    def prefix_granule(self) -> int:
        """Lengths a prefix hold may have are multiples of this: every group's tokens per block
        (then the request that made it writes only blocks past the hold's columns)."""
        return math.lcm(*(g.tokens_per_block for g in self.groups))

    # ---- queries -------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """The shared pool (only when built with an int ``num_blocks``)."""
        if self._shared is None:
            raise ValueError("this manager has one pool per group: use manager.pools[group]")
        return self._shared

    @property
    def shared_pool(self) -> bool:
        return self._shared is not None

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

    def blocks_needed_by_group(self, req_id: Hashable | None, num_tokens: int) -> dict[str, int]:
        """Blocks per group a grow to ``num_tokens`` would take (``None``: a new request)."""
        have = self._tables.get(req_id) if req_id is not None else None
        if have is not None and num_tokens <= self._cover[req_id]:
            return dict.fromkeys(have, 0)  # no new column in any group (most decode steps)
        out = {}
        for g in self.groups:
            cur = len(have[g.name]) if have is not None else 0
            lo = self._first_live_col(g, self._floor.get(req_id, 0)) if have is not None else 0
            out[g.name] = max(0, cdiv(num_tokens, g.tokens_per_block) - max(cur, lo))
        return out

    def blocks_needed(self, req_id: Hashable | None, num_tokens: int) -> int:
        """Blocks a grow to ``num_tokens`` would take from the pool(s) in all (``None``: new)."""
        return sum(self.blocks_needed_by_group(req_id, num_tokens).values())

    def shortfall(self, demand: Mapping[str, int]) -> list[tuple[str, int, BlockPool]]:
        """Groups whose pool cannot serve ``demand`` (group -> blocks; groups sharing a pool
        are summed): ``[(group(s), need, pool)]``, empty when everything fits."""
        by_pool: dict[int, tuple[list[str], int, BlockPool]] = {}
        for name, n in demand.items():
            p = self.pools[name]
            names, need, _ = by_pool.get(id(p), ([], 0, p))
            by_pool[id(p)] = (names + [name], need + n, p)
        return [("+".join(names), need, p) for names, need, p in by_pool.values() if need > p.num_free]

    # ---- mutations ---------------------------------------------------------------------
    def add_request(self, req_id: Hashable, num_tokens: int = 0, prefix: PrefixHold | None = None) -> None:
        """Register ``req_id`` and allocate for its first ``num_tokens`` tokens (all or nothing).

        ``prefix``: a :class:`PrefixHold` of this manager; the request starts with
        ``prefix.num_tokens`` tokens already computed, reading the hold's blocks (shared, never
        written again: the request writes positions from ``prefix.num_tokens`` on, which lie in
        later columns). ``num_tokens`` then counts from 0 too and is raised to the prefix length."""
        if req_id is None:
            raise ValueError("request id must not be None")
        try:
            hash(req_id)
        except TypeError:
            raise TypeError(f"request id must be hashable, got {type(req_id).__name__}") from None
        if req_id in self._tables:
            raise ValueError(f"request {req_id!r} already exists")
        _count("num_tokens", num_tokens)
        start = 0
        if prefix is not None:
            self._check_hold(prefix)
            start = prefix.num_tokens
            num_tokens = max(num_tokens, start)
            need = {g.name: max(0, cdiv(num_tokens, g.tokens_per_block) - len(prefix._tables[g.name]))
                    for g in self.groups}
        else:
            need = self.blocks_needed_by_group(None, num_tokens)
        self._raise_if_short(req_id, need, num_tokens, "")
        if prefix is not None:
            for g in self.groups:
                self.pools[g.name].share([b for b in prefix._tables[g.name] if b != NULL_BLOCK])
            self._tables[req_id] = {g.name: list(prefix._tables[g.name]) for g in self.groups}
            self._reclaimed[req_id] = {g.name: self._first_live_col(g, start) for g in self.groups}
        else:
            self._tables[req_id] = {g.name: [] for g in self.groups}
            self._reclaimed[req_id] = {g.name: 0 for g in self.groups}
        self._num_tokens[req_id] = start
        self._num_computed[req_id] = start
        self._floor[req_id] = start
        self._cover[req_id] = self._covered_tokens(self._tables[req_id])
        self._reclaim_at[req_id] = self._next_reclaim(req_id)
        self._row[req_id] = self._take_row()
        for name in self._img:
            if self._tables[req_id][name]:
                self._img_write(name, self._row[req_id], 0, self._tables[req_id][name])
        self.grow(req_id, num_tokens)

    # ---- prefix holds --------------------------------------------------------------------
    def hold_prefix(self, req_id: Hashable, num_tokens: int, written: int | None = None) -> PrefixHold:
        """Keep (by reference) what a request needs to continue from ``num_tokens`` tokens, so
        another request can start there (:meth:`add_request` with ``prefix=``) after this one
        moved on or was freed. ``num_tokens``: a positive multiple of :attr:`prefix_granule`, at
        most the tokens in the caches, and not so far behind that a sliding group already
        released what position ``num_tokens`` reads. Holding *accepts* the held tokens: the
        request's rollback floor rises to ``num_tokens`` (a held block must never be rewritten).
        ``written``: inside a step (every layer ran), the step's end; then only tokens no
        rollback can take back after the step (``written - rollback_tokens``) can be held, and
        the floor is left to the step's ``advance``. Changes nothing on error."""
        self._check(req_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        gran = self.prefix_granule
        if num_tokens % gran:
            raise ValueError(f"num_tokens must be a multiple of the prefix granule {gran} (every group's "
                             f"tokens per block), got {num_tokens}")
        computed = self._num_computed[req_id]
        if written is None:
            limit = computed
        else:
            if not computed <= _count("written", written) <= self._num_tokens[req_id]:
                raise ValueError(f"written must be in [{computed}, {self._num_tokens[req_id]}] for {req_id!r}, "
                                 f"got {written}")
            limit = max(self._floor[req_id], written - self.rollback_tokens)
        if num_tokens > limit:
            raise ValueError(f"num_tokens {num_tokens} > {limit} for {req_id!r}: only tokens in the caches (and, inside "
                             "a step with speculative tokens, none a rollback could take back) can be held")
        tables = self._tables[req_id]
        out: dict[str, tuple[int, ...]] = {}
        for g in self.groups:
            lo, hi = self._first_live_col(g, num_tokens), num_tokens // g.tokens_per_block
            if lo < self._reclaimed[req_id][g.name]:
                raise ValueError(f"num_tokens {num_tokens} is too far behind request {req_id!r}: group {g.name!r} "
                                 f"already released the blocks position {num_tokens} reads")
            out[g.name] = (NULL_BLOCK,) * lo + tuple(tables[g.name][lo:hi])
        for g in self.groups:
            self.pools[g.name].share([b for b in out[g.name] if b != NULL_BLOCK])
        if written is None:
            self._floor[req_id] = max(self._floor[req_id], num_tokens)
        hold = PrefixHold(self, num_tokens, out)
        self._holds[id(hold)] = hold
        return hold

    def new_prefix(self, num_tokens: int, columns: Mapping[str, Sequence[bool]]) -> PrefixHold:
        """A hold on fresh blocks (for cache contents brought in from elsewhere: a prefix exported
        by another engine or offloaded): ``columns[group][c]`` says whether column ``c`` (of
        ``num_tokens // tokens_per_block``) holds a block. Raises (taking nothing) ValueError for
        a bad shape and :class:`PoolExhaustedError` when a pool is short."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1 \
                or num_tokens % self.prefix_granule:
            raise ValueError(f"num_tokens must be a positive multiple of {self.prefix_granule}, got {num_tokens!r}")
        if not isinstance(columns, Mapping) or set(columns) != {g.name for g in self.groups}:
            raise ValueError(f"columns must name exactly the groups {[g.name for g in self.groups]}")
        need = {}
        for g in self.groups:
            cols = list(columns[g.name])
            if len(cols) != num_tokens // g.tokens_per_block or not all(isinstance(c, bool) for c in cols):
                raise ValueError(f"columns[{g.name!r}] must be {num_tokens // g.tokens_per_block} bools")
            need[g.name] = sum(cols)
        self._raise_if_short("(prefix)", need, num_tokens, "")
        out: dict[str, tuple[int, ...]] = {}
        for g in self.groups:
            ids = iter(self.pools[g.name].take(need[g.name]))
            out[g.name] = tuple(next(ids) if c else NULL_BLOCK for c in columns[g.name])
        hold = PrefixHold(self, num_tokens, out)
        self._holds[id(hold)] = hold
        return hold

    def release_prefix(self, hold: PrefixHold) -> int:
        """Drop a hold's references; returns the blocks that became free."""
        self._check_hold(hold)
        before = {id(p): p.num_free for p in self.pools.values()}
        for g in self.groups:
            self.pools[g.name].give_back([b for b in hold._tables[g.name] if b != NULL_BLOCK])
        del self._holds[id(hold)]
        hold._live = False
        return sum(p.num_free - before[id(p)] for p in {id(p): p for p in self.pools.values()}.values())

    def _check_hold(self, hold: object) -> None:
        if not isinstance(hold, PrefixHold):
            raise TypeError(f"prefix must be a PrefixHold, got {type(hold).__name__}")
        if hold._owner is not self:
            raise ValueError("prefix hold belongs to another manager")
        if not hold._live or self._holds.get(id(hold)) is not hold:
            raise ValueError("prefix hold was released")

    def grow(self, req_id: Hashable, num_tokens: int) -> None:
        """Make every group cover raw positions ``0 .. num_tokens-1`` (sliding groups: only the
        still-visible ones). Shrinking is not allowed (see :meth:`truncate`); raises
        :class:`PoolExhaustedError` without changing anything when a pool is short."""
        self._check(req_id)
        _count("num_tokens", num_tokens)
        if num_tokens < self._num_tokens[req_id]:
            raise ValueError(f"num_tokens {num_tokens} < current {self._num_tokens[req_id]} for {req_id!r}")
        tables = self._tables[req_id]
        if num_tokens <= self._cover[req_id]:
            self._num_tokens[req_id] = num_tokens  # no new column in any group (most decode steps)
            return
        need = self.blocks_needed_by_group(req_id, num_tokens)
        self._raise_if_short(req_id, need, num_tokens, "more ")
        for g in self.groups:
            ids = iter(self.pools[g.name].take(need[g.name]))
            table = tables[g.name]
            want = cdiv(num_tokens, g.tokens_per_block)
            lo = self._first_live_col(g, self._floor[req_id])
            old = len(table)
            while len(table) < want:
                table.append(next(ids) if len(table) >= lo else NULL_BLOCK)
            assert next(ids, None) is None
            if g.name in self._img and len(table) > old:
                self._img_write(g.name, self._row[req_id], old, table[old:])
        self._num_tokens[req_id] = num_tokens
        self._cover[req_id] = self._covered_tokens(tables)

    def truncate(self, req_id: Hashable, num_tokens: int) -> int:
        """Undo a grow: keep columns for raw positions ``0 .. num_tokens-1`` only and return the
        blocks past them. ``num_tokens`` must be >= the computed count (tokens already in the
        caches stay). Returns the number of blocks given back."""
        self._check(req_id)
        _count("num_tokens", num_tokens)
        if not self._num_computed[req_id] <= num_tokens <= self._num_tokens[req_id]:
            raise ValueError(f"num_tokens must be in [{self._num_computed[req_id]}, {self._num_tokens[req_id]}] "
                             f"for {req_id!r}, got {num_tokens}")
        freed = 0
        tables = self._tables[req_id]
        if all(len(tables[g.name]) <= cdiv(num_tokens, g.tokens_per_block) for g in self.groups):
            self._num_tokens[req_id] = num_tokens  # no column to cut in any group
            return 0
        for g in self.groups:
            table = tables[g.name]
            keep = cdiv(num_tokens, g.tokens_per_block)
            ids = [b for b in table[keep:] if b != NULL_BLOCK]
            self.pools[g.name].give_back(ids)
            if g.name in self._img and len(table) > keep:
                self._img_write(g.name, self._row[req_id], keep, [NULL_BLOCK] * (len(table) - keep))
            del table[keep:]
            freed += len(ids)
        self._num_tokens[req_id] = num_tokens
        self._cover[req_id] = self._covered_tokens(tables)
        self._reclaim_at[req_id] = self._next_reclaim(req_id)
        return freed

    def advance(self, req_id: Hashable, num_computed: int) -> int:
        """Record that tokens ``0 .. num_computed-1`` are in the caches; sliding groups return
        the blocks no later token can read. Returns the number of blocks freed."""
        self._check(req_id)
        _count("num_computed", num_computed)
        if not self._num_computed[req_id] <= num_computed <= self._num_tokens[req_id]:
            raise ValueError(
                f"num_computed must be in [{self._num_computed[req_id]}, {self._num_tokens[req_id]}] "
                f"for {req_id!r}, got {num_computed}"
            )
        self._num_computed[req_id] = num_computed
        self._floor[req_id] = max(self._floor[req_id], num_computed - self.rollback_tokens)
        return self._reclaim(req_id)

    def rollback_floor(self, req_id: Hashable) -> int:
        """Lowest length :meth:`rollback` may take ``req_id`` back to."""
        return self._floor[self._check(req_id)]

    def rollback(self, req_id: Hashable, num_tokens: int) -> int:
        """Take computed tokens back: the request continues from length ``num_tokens`` (in
        ``[rollback_floor, num_computed]``) exactly as if the later tokens had never been
        appended. Columns past ``cdiv(num_tokens, tokens_per_block)`` go back to the pools
        (cost: the columns undone). Returns the number of blocks given back."""
        self._check(req_id)
        _count("num_tokens", num_tokens)
        if not self._floor[req_id] <= num_tokens <= self._num_computed[req_id]:
            raise ValueError(f"num_tokens must be in [{self._floor[req_id]}, {self._num_computed[req_id]}] for "
                             f"{req_id!r} (rollback floor, computed), got {num_tokens}")
        self._num_computed[req_id] = num_tokens
        return self.truncate(req_id, num_tokens)

    def commit(self, req_id: Hashable, num_tokens: int | None = None) -> int:
        """Accept the first ``num_tokens`` (default: all computed) tokens: the rollback floor
        rises to it and sliding groups return what only a rollback could have read. Returns
        the number of blocks freed."""
        self._check(req_id)
        n = self._num_computed[req_id] if num_tokens is None else _count("num_tokens", num_tokens)
        if n > self._num_computed[req_id]:
            raise ValueError(f"num_tokens must be <= computed {self._num_computed[req_id]} for {req_id!r}, got {n}")
        self._floor[req_id] = max(self._floor[req_id], n)
        return self._reclaim(req_id)

    def _reclaim(self, req_id: Hashable) -> int:
        """Give back the sliding columns no token at or after the rollback floor can read."""
        floor, done = self._floor[req_id], self._reclaimed[req_id]
        if floor < self._reclaim_at[req_id]:
            return 0  # no sliding column newly out of reach (most steps)
        freed = 0
        for g in self.groups:
            if g.kind == "full":
                continue  # full groups keep every column
            table = self._tables[req_id][g.name]
            hi = min(self._first_live_col(g, floor), len(table))
            if hi <= done[g.name]:
                continue  # nothing newly out of reach (most steps)
            ids = []
            for c in range(done[g.name], hi):
                if table[c] != NULL_BLOCK:
                    ids.append(table[c])
                    table[c] = NULL_BLOCK
            done[g.name] = hi
            if ids:
                self.pools[g.name].give_back(ids)
            freed += len(ids)
        self._reclaim_at[req_id] = self._next_reclaim(req_id)
        return freed

    def _next_reclaim(self, req_id: Hashable) -> int:
        """Lowest rollback floor at which some sliding group's first live column passes the
        columns already reclaimed (``_first_live_col(g, f) > done`` first holds at
        ``f = (done + 1) * tokens_per_block + window - 1``); a huge number without sliding
        groups. Columns past the table's end are never reclaimed, which this bound ignores:
        reaching it only runs the full check."""
        done = self._reclaimed[req_id]
        return min((((done[g.name] + 1) * g.tokens_per_block + (g.window or 0) - 1)
                    for g in self.groups if g.kind != "full"), default=1 << 62)

    def covers(self, req_id: Hashable, num_tokens: int) -> bool:
        """Whether a known request's tables already have a column for every position below
        ``num_tokens`` in every group (a grow to it then takes no block)."""
        self._check(req_id)
        return _count("num_tokens", num_tokens) <= self._cover[req_id]

    def _covered_tokens(self, tables: Mapping[str, list[int]]) -> int:
        """Tokens every group's table has a column for: ``min len(table) * tokens_per_block``."""
        return min((len(tables[g.name]) * g.tokens_per_block for g in self.groups), default=1 << 62)

    def free(self, req_id: Hashable) -> int:
        """Forget ``req_id`` and return all its blocks to the pools; returns how many."""
        tables = self._tables.pop(self._check(req_id))
        del self._num_tokens[req_id], self._num_computed[req_id], self._reclaimed[req_id], self._floor[req_id]
        del self._cover[req_id], self._reclaim_at[req_id]
        row = self._row.pop(req_id)
        n = 0
        for name, t in tables.items():
            ids = [b for b in t if b != NULL_BLOCK]
            self.pools[name].give_back(ids)
            n += len(ids)
            if name in self._img:
                self._img[name][row, :len(t)] = NULL_BLOCK
        self._free_rows.append(row)
        return n

    def _take_row(self) -> int:
        """A free row of the export images (grown by doubling when every row is live)."""
        if self._free_rows:
            return self._free_rows.pop()
        row = self._rows_used
        self._rows_used += 1
        for name, img in self._img.items():
            if row >= img.shape[0]:
                new = torch.full((max(8, 2 * img.shape[0]), img.shape[1]), NULL_BLOCK, dtype=torch.int32)
                new[:img.shape[0]] = img
                self._img[name] = new
        return row

    def _img_write(self, name: str, row: int, col: int, values: Sequence[int]) -> None:
        """Columns ``col ..`` of a row of group ``name``'s export image (grown by doubling)."""
        img = self._img[name]
        end = col + len(values)
        if end > img.shape[1]:
            new = torch.full((img.shape[0], max(end, 2 * img.shape[1], 16)), NULL_BLOCK, dtype=torch.int32)
            new[:, :img.shape[1]] = img
            self._img[name] = img = new
        img[row, col:end] = torch.tensor(values, dtype=torch.int32)

    # ---- export ---------------------------------------------------------------------------
    def block_table(self, req_ids: Sequence[Hashable], group: str, width: int | None = None,
                    device: torch.device | str = "cpu", out: torch.Tensor | None = None,
                    first_cols: Sequence[int] | None = None, align: int = 1) -> torch.Tensor:
        """``[len(req_ids), width]`` int32 block table of ``group`` (rows in ``req_ids`` order),
        padded with ``NULL_BLOCK``. ``width`` defaults to the longest row; a fixed capacity width
        keeps the tensor shape stable for CUDA graphs. Raises if a row does not fit. ``out``: a
        CPU int32 ``[len(req_ids), >= longest]`` tensor to fill and return instead (``width``
        and ``device`` are then ignored). Full groups: one row gather from the group's export
        image (kept up to date where tables change). Sliding groups: their live columns become one
        tensor, written with one scatter (short rows) or one slice per row (long rows). Either
        way the host cost follows what changed or what is live, not a tensor per row.

        ``first_cols`` (sliding groups): row i holds the request's columns from ``first_cols[i]``
        on (column c at ``c - first_cols[i]``; a *windowed* table, whose users shift positions by
        ``first_cols[i] * tokens_per_block``), so its width follows the live window, not the
        context (a state group's columns are raw positions / 4 or / 8).

        ``align``: the default width is the longest row rounded up to a multiple of it (the
        engine passes 16: Triton specialises integer arguments by divisibility by 16, so widths
        that wander with the context would compile new kernel variants while serving)."""
        g = self._group(group)
        rows = [self._tables[self._check(r)][g.name] for r in req_ids]
        skip = [self._reclaimed[r][g.name] for r in req_ids]  # leading columns known to be NULL_BLOCK
        if first_cols is None:
            firsts = [0] * len(rows)
        else:
            if g.kind == "full":
                raise ValueError(f"first_cols is for sliding groups; {g.name!r} is a full group")
            firsts = [_count("first_cols[i]", f) for f in first_cols]
            if len(firsts) != len(rows):
                raise ValueError(f"first_cols has {len(firsts)} entries for {len(rows)} requests")
        longest = max((max(0, len(r) - f) for r, f in zip(rows, firsts)), default=0)
        if out is not None:
            if out.dtype != torch.int32 or out.device.type != "cpu" or out.dim() != 2 or out.shape[0] != len(rows):
                raise ValueError(f"out must be a CPU int32 [{len(rows)}, width] tensor, got {out.dtype} "
                                 f"{tuple(out.shape)} on {out.device}")
            width = out.shape[1]
        else:
            if isinstance(align, bool) or not isinstance(align, int) or align < 1:
                raise ValueError(f"align must be a positive int, got {align!r}")
            width = cdiv(longest, align) * align if width is None else width
        if width < longest:
            raise ValueError(f"width {width} < longest {g.name} block table ({longest} columns)")
        table = out if out is not None else torch.empty((len(rows), width), dtype=torch.int32)
        img = self._img.get(g.name)
        if img is not None:  # a full group: gather the rows of its export image
            w = min(width, img.shape[1])  # the image is NULL_BLOCK past every row's end
            if rows and w:
                table[:, :w] = img[:, :w].index_select(0, torch.tensor([self._row[r] for r in req_ids]))
            if w < width:
                table[:, w:] = NULL_BLOCK
            return table if out is not None else table.to(device)
        table.fill_(NULL_BLOCK)
        # host work: the live columns of each row only (sliding groups: a few per row)
        live = [(i, max(lo, f), len(row)) for i, (row, lo, f) in enumerate(zip(rows, skip, firsts))
                if len(row) > max(lo, f)]
        if live:
            vals = torch.tensor(list(chain.from_iterable(rows[i][lo:hi] for i, lo, hi in live)), dtype=torch.int32)
            if len(vals) > 64 * len(live):  # long rows: one slice copy per row beats per-value indices
                at = 0
                for i, lo, hi in live:
                    table[i, lo - firsts[i]:hi - firsts[i]] = vals[at:at + hi - lo]
                    at += hi - lo
                return table if out is not None else table.to(device)
            counts = torch.tensor([hi - lo for _, lo, hi in live])
            begin = torch.cumsum(counts, 0) - counts  # each live row's first value in vals
            rows_t = torch.tensor([i for i, _, _ in live]).repeat_interleave(counts)
            # column of each value: its row's first live column (shifted) + its rank within the row
            cols = ((torch.tensor([lo - firsts[i] for i, lo, _ in live]) - begin).repeat_interleave(counts)
                    + torch.arange(len(vals)))
            table[rows_t, cols] = vals
        return table if out is not None else table.to(device)

    # ---- helpers --------------------------------------------------------------------------
    def _raise_if_short(self, req_id: Hashable, need: Mapping[str, int], num_tokens: int, more: str) -> None:
        short = self.shortfall(need)
        if short:
            name, n, p = short[0]
            raise PoolExhaustedError(
                f"request {req_id!r} needs {n} {more}blocks of group {name!r} to reach {num_tokens} tokens, "
                f"only {p.num_free} of {p.num_blocks} free")

    @staticmethod
    def _first_live_col(g: GroupSpec, num_computed: int) -> int:
        """First column a future token may read (0 for full groups)."""
        if g.kind == "full":
            return 0
        assert g.window is not None  # sliding groups are checked for a positive window in __init__
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
