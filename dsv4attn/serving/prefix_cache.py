"""Prefix caching for generation: token prefixes -> engine prefix holds, least recently used out.

A :class:`PrefixCache` maps token prefixes whose length is a multiple of the engine's
``prefix_granule`` (256 tokens with the default block sizes) to
:class:`dsv4attn.kv_cache.allocator.PrefixHold` objects: what those tokens left in every cache
group (compressed and indexer blocks below the prefix end, the sliding-window and compressor
state blocks the next token reads), kept by reference. A new request whose prompt starts with a
cached prefix starts from the hold and computes only the rest; its logits are those of a cold
run (the caches it reads hold the same bytes).

The keys are a trie of whole granules (tuples of token ids, compared exactly: no hash can make
two different prefixes meet). The cache keeps at most the engine's ``max_cached_prefixes`` holds
and gives the least recently used (saved or hit) back first, also when the context-sized pool
needs room for a request being admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from dsv4attn.kv_cache.allocator import PrefixHold

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixBlob:
    """A prefix hold's cache contents outside the engine (``engine.export_prefix``; brought back
    by ``engine.import_prefix`` into an engine of the same geometry): for KV transfer between
    engines (a prefill engine handing prompts to a decode engine) or offload to host memory.

    ``num_tokens``: the prefix length; ``columns``: per cache group, which table columns hold a
    block (window groups keep only the last few); ``pages``: per layer, per cache (``swa``,
    ``compressed``, ``indexer_k``, ``state``, ``indexer_state``), the whole pages of those blocks
    in column order, every byte of each page (``[blocks, page elements]`` in the cache's dtype:
    uint8 for fp8_ds_mla pages, whose format docs/cache-format.md documents); ``signature``: the
    geometry the pages belong to. Plain tensors and tuples: ``torch.save`` / ``torch.load``
    carry it."""

    num_tokens: int
    columns: dict[str, tuple[bool, ...]]
    pages: tuple[dict[str, torch.Tensor], ...]
    signature: tuple

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for layer in self.pages for t in layer.values())


@dataclass
class PrefixCacheStats:
    """Counts since the cache was made: ``lookups`` (requests admitted while it was on), ``hits``
    (requests that started from a hold), ``hit_tokens`` (prompt tokens not computed), ``saved``
    and ``evicted`` holds, ``refused``: saves the engine refused (logged; none expected)."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    saved: int = 0
    evicted: int = 0
    refused: int = 0


@dataclass
class _Node:
    parent: _Node | None
    key: tuple[int, ...] | None  # the granule that leads here from the parent
    length: int  # tokens of the prefix this node stands for
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    hold: PrefixHold | None = None
    used: int = 0  # clock of the last save or hit


class PrefixCache:
    """Token prefixes -> prefix holds of one :class:`PagedAttentionEngine` (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.granule: int = engine.prefix_granule
        self.capacity: int = engine.max_cached_prefixes
        self.stats = PrefixCacheStats()
        self._root = _Node(None, None, 0)
        self._held: dict[int, _Node] = {}  # id(hold) -> its node
        self._clock = 0

    def __len__(self) -> int:
        return len(self._held)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, PrefixHold | None]:
        """The longest cached prefix of ``tokens`` of at most ``limit`` tokens: ``(length, hold)``,
        ``(0, None)`` when none."""
        node, best = self._root, self._root
        g = self.granule
        for end in range(g, min(limit, len(tokens)) + 1, g):
            child = node.children.get(tuple(tokens[end - g:end]))
            if child is None:
                break
            node = child
            if node.hold is not None and not node.hold.released:
                best = node
        return best.length, best.hold

    def use(self, hold: PrefixHold, tokens: int) -> None:
        """Record a hit on ``hold`` (``tokens`` prompt tokens not computed)."""
        self._held[id(hold)].used = self._tick()
        self.stats.hits += 1
        self.stats.hit_tokens += tokens

    def has(self, tokens: Sequence[int], length: int) -> bool:
        """Whether the prefix ``tokens[:length]`` already has a hold."""
        node = self._root
        g = self.granule
        for end in range(g, length + 1, g):
            nxt = node.children.get(tuple(tokens[end - g:end]))
            if nxt is None:
                return False
            node = nxt
        return node.hold is not None and not node.hold.released

    def save(self, request_id: Hashable, tokens: Sequence[int], length: int) -> None:
        """Hold ``request_id``'s first ``length`` tokens (``tokens[:length]``; see
        :meth:`PagedAttentionEngine.save_prefix` for when) unless that prefix is held already;
        makes room by giving the least recently used hold back."""
        if self.capacity == 0 or self.has(tokens, length):
            return
        self._drop_released()
        while len(self._held) >= self.capacity:
            self.evict_one()
        try:
            hold = self.engine.save_prefix(request_id, length)
        except ValueError as e:  # a cache that cannot save only loses a future hit
            self.stats.refused += 1
            logger.warning("prefix cache: hold of %d tokens of %r refused: %s", length, request_id, e)
            return
        node = self._root
        g = self.granule
        for end in range(g, length + 1, g):
            key = tuple(tokens[end - g:end])
            nxt = node.children.get(key)
            if nxt is None:
                nxt = node.children[key] = _Node(node, key, end)
            node = nxt
        node.hold, node.used = hold, self._tick()
        self._held[id(hold)] = node
        self.stats.saved += 1

    def evict_one(self, keep: PrefixHold | None = None) -> bool:
        """Give the least recently used hold (other than ``keep``) back; False when none is left."""
        cands = [n for n in self._held.values() if n.hold is not keep]
        if not cands:
            return False
        node = min(cands, key=lambda n: n.used)
        hold = node.hold
        assert hold is not None
        del self._held[id(hold)]
        node.hold = None
        if not hold.released:
            self.engine.release_prefix(hold)
        self.stats.evicted += 1
        self._prune(node)
        return True

    def _drop_released(self) -> None:
        """Forget holds the engine released itself (those of an aborted step)."""
        for key, node in list(self._held.items()):
            if node.hold is not None and node.hold.released:
                del self._held[key]
                node.hold = None
                self._prune(node)

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and node.hold is None and not node.children:  # prune empty branches
            assert node.key is not None
            del node.parent.children[node.key]
            node = node.parent

    def clear(self) -> None:
        """Give every hold back."""
        while self.evict_one():
            pass
