"""Cache memory accounting: bytes per group and per request, and the footprint of a context.

:func:`request_footprint` answers "how many cache bytes does one request of ``num_tokens``
tokens hold in this model?" from the specs alone (no allocation): full groups hold
``cdiv(num_tokens, tokens_per_block)`` blocks, sliding groups only the blocks still visible to
later tokens (the allocator's state after ``advance``). :func:`dense_mla_bytes` gives the
comparison point: one 584 B (fp8_ds_mla) or 1024 B (bf16) entry per token per layer.

Sizing (memory by need): :func:`plan_num_blocks` gives every cache group its own pool, sized by
its geometry (window-bounded groups by the window and the live-request / step-token limits, the
context-sized group by the budget); :func:`memory_for_requests` answers "how much for N requests
of length L" and :func:`max_requests` "how many requests of length L fit in X bytes".
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from dsv4attn.kv_cache.allocator import KVCacheManager, cdiv
from dsv4attn.kv_cache.specs import CacheConfig, GroupSpec, cache_groups

#: Bytes per token per layer of a dense MLA cache in fp8_ds_mla (448 fp8 + 64 bf16 + 8 scale).
DENSE_FP8_DS_MLA_BYTES = 584
#: Bytes per token per layer of a dense bf16 MLA cache (512 bf16).
DENSE_BF16_BYTES = 1024


@dataclass(frozen=True)
class GroupFootprint:
    """Blocks and bytes one request holds in one group; ``per_cache`` maps cache name to bytes
    summed over the group's layers."""

    group: str
    kind: str
    blocks: int
    bytes: int
    per_cache: dict[str, int]


@dataclass(frozen=True)
class Footprint:
    num_tokens: int
    groups: tuple[GroupFootprint, ...]

    @property
    def total_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    def by_cache(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            for k, v in g.per_cache.items():
                out[k] = out.get(k, 0) + v
        return out


def blocks_held(group: GroupSpec, num_tokens: int, step_tokens: int = 0) -> int:
    """Blocks a request with ``num_tokens`` computed tokens holds in ``group`` once the next
    ``step_tokens`` tokens are allocated: the :class:`KVCacheManager` state after
    ``grow(num_tokens + step_tokens)`` and ``advance(num_tokens)``."""
    end = cdiv(num_tokens + step_tokens, group.tokens_per_block)
    if group.kind == "full":
        return end
    assert group.window is not None  # sliding groups carry a window (KVCacheManager refuses others)
    first = max(0, num_tokens - group.window + 1) // group.tokens_per_block
    return end - first


def group_footprint(group: GroupSpec, blocks: int) -> GroupFootprint:
    per_cache: dict[str, int] = {}
    for c in group.caches:
        per_cache[c.name] = per_cache.get(c.name, 0) + blocks * c.page_bytes
    return GroupFootprint(group.name, group.kind, blocks, blocks * group.page_bytes_per_block, per_cache)


def request_footprint(cfg: CacheConfig, num_tokens: int, step_tokens: int = 0) -> Footprint:
    """Cache bytes of one request with ``num_tokens`` tokens in its caches and ``step_tokens``
    more allocated (see :func:`blocks_held`)."""
    if num_tokens < 0 or step_tokens < 0:
        raise ValueError(f"num_tokens and step_tokens must be >= 0, got {num_tokens}, {step_tokens}")
    groups = tuple(group_footprint(g, blocks_held(g, num_tokens, step_tokens)) for g in cache_groups(cfg))
    return Footprint(num_tokens, groups)


def dense_mla_bytes(num_layers: int, num_tokens: int, bytes_per_token_layer: int = DENSE_FP8_DS_MLA_BYTES) -> int:
    """A dense (uncompressed, unwindowed) MLA cache: one entry per token per layer."""
    return num_layers * num_tokens * bytes_per_token_layer


def manager_bytes(manager: KVCacheManager, req_id: Hashable) -> dict[str, int]:
    """Bytes request ``req_id`` holds now in each group of ``manager`` (held blocks x the
    group's page bytes over all its layers)."""
    return {g.name: manager.num_held(req_id, g.name) * g.page_bytes_per_block for g in manager.groups}


def pool_bytes(groups: list[GroupSpec], num_blocks: int) -> int:
    """Bytes of a pool of ``num_blocks`` ids when every group's caches get their own tensor of
    ``num_blocks`` pages (upper bound; vLLM shares tensors across groups, sec. 3.3)."""
    return num_blocks * sum(g.page_bytes_per_block for g in groups)


def footprint_table(cfg: CacheConfig, contexts: tuple[int, ...] = (4096, 65536, 1 << 20)) -> str:
    """A markdown table of per-cache bytes per request vs dense fp8_ds_mla / bf16 MLA caches."""
    fps = [request_footprint(cfg, n) for n in contexts]
    names = list(fps[0].by_cache())
    gib = 1 << 30
    head = "| cache | " + " | ".join(f"{n} tokens" for n in contexts) + " |"
    lines = [head, "|" + "---|" * (len(contexts) + 1)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{fp.by_cache()[name] / gib:.4f} GiB" for fp in fps) + " |")
    lines.append("| **total** | " + " | ".join(f"**{fp.total_bytes / gib:.3f} GiB**" for fp in fps) + " |")
    for label, b in (("dense MLA fp8_ds_mla (584 B)", DENSE_FP8_DS_MLA_BYTES),
                     ("dense MLA bf16 (1024 B)", DENSE_BF16_BYTES)):
        lines.append(f"| {label} | " + " | ".join(
            f"{dense_mla_bytes(cfg.num_layers, n, b) / gib:.3f} GiB" for n in contexts) + " |")
    return "\n".join(lines)


# ---- sizing: memory by need ---------------------------------------------------------------
def sliding_pool_blocks(group: GroupSpec, max_num_reqs: int, max_num_batched_tokens: int,
                        rollback_tokens: int = 0, prefix_holds: int = 0) -> int:
    """Blocks a sliding group's own pool needs so it can never run short: every live request
    holds at most ``cdiv(W - 1 + c, bs) + 1`` blocks while ``c`` of its tokens are in flight
    (``sliding_blocks_bound``), and the in-flight tokens of a step sum to at most
    ``max_num_batched_tokens``: ``R * (cdiv(W - 1, bs) + 2) + cdiv(T, bs)``. With
    ``rollback_tokens = k`` (speculative decoding) a request also keeps the columns of its last
    ``k`` computed tokens' windows: ``W - 1`` becomes ``W - 1 + k``. ``prefix_holds``: prefix
    holds kept besides the requests (prefix caching), each at most ``cdiv(W - 1, bs)`` blocks
    (what a token at a block boundary reads)."""
    assert group.kind == "sliding" and group.window is not None
    bs = group.tokens_per_block
    return (max_num_reqs * (cdiv(group.window - 1 + rollback_tokens, bs) + 2) + cdiv(max_num_batched_tokens, bs)
            + prefix_holds * cdiv(group.window - 1, bs))


def main_group(cfg: CacheConfig) -> GroupSpec:
    """The group whose size grows with the context: ``full_mla`` (or ``swa`` in a model
    without compressed layers, whose caches are all bounded by the window)."""
    groups = cache_groups(cfg)
    return next((g for g in groups if g.kind == "full"), groups[0])


def plan_num_blocks(
    cfg: CacheConfig, *, max_num_reqs: int, max_num_batched_tokens: int, max_model_len: int,
    num_blocks: int | None = None, memory_bytes: int | None = None, rollback_tokens: int = 0,
    prefix_holds: int = 0,
) -> dict[str, int]:
    """Blocks of every group's own pool (group name -> count), by each group's geometry.

    Sliding groups get :func:`sliding_pool_blocks` (bounded by their window, never short). The
    full group gets ``num_blocks`` if given, else what ``memory_bytes`` leaves after the
    sliding groups, else room for ``max_num_reqs`` requests of ``max_model_len`` tokens. In a
    model of sliding layers only the SWA group takes that role (default: its window bound).
    Raises ``ValueError`` when ``memory_bytes`` is too small.
    ``rollback_tokens``: the engine's ``num_speculative_tokens``; ``prefix_holds``: its
    ``max_cached_prefixes`` (both: see :func:`sliding_pool_blocks`).
    """
    for name, v in (("max_num_reqs", max_num_reqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(prefix_holds, bool) or not isinstance(prefix_holds, int) or prefix_holds < 0:
        raise ValueError(f"prefix_holds must be an int >= 0, got {prefix_holds!r}")
    if num_blocks is not None and memory_bytes is not None:
        raise ValueError("give num_blocks or memory_bytes, not both")
    main = main_group(cfg)
    out: dict[str, int] = {}
    fixed = 0
    for g in cache_groups(cfg):
        if g.kind == "sliding" and g.name != main.name:
            out[g.name] = sliding_pool_blocks(g, max_num_reqs, max_num_batched_tokens, rollback_tokens, prefix_holds)
            fixed += out[g.name] * g.page_bytes_per_block
    if num_blocks is not None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        n = num_blocks
    elif memory_bytes is not None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 1:
            raise ValueError(f"memory_bytes must be a positive int, got {memory_bytes!r}")
        n = (memory_bytes - fixed) // main.page_bytes_per_block
        if n < 1:
            raise ValueError(f"memory_bytes={memory_bytes} leaves no {main.name!r} block: the window-bounded "
                             f"groups alone take {fixed} B for max_num_reqs={max_num_reqs}; raise memory_bytes "
                             "or lower max_num_reqs / max_num_batched_tokens")
    elif main.kind == "sliding":  # sliding layers only: the window bounds everything
        n = sliding_pool_blocks(main, max_num_reqs, max_num_batched_tokens, rollback_tokens, prefix_holds)
    else:
        n = max_num_reqs * cdiv(max_model_len, main.tokens_per_block)
    out[main.name] = n
    return {g.name: out[g.name] for g in cache_groups(cfg)}


def pool_bytes_by_group(cfg: CacheConfig, num_blocks: dict[str, int]) -> dict[str, int]:
    """Bytes the caches of pools of ``num_blocks`` (group -> count) take, per group."""
    return {g.name: num_blocks[g.name] * g.page_bytes_per_block for g in cache_groups(cfg)}


def memory_for_requests(cfg: CacheConfig, num_requests: int, num_tokens: int, max_num_batched_tokens: int = 1) -> int:
    """Cache bytes an engine needs so ``num_requests`` requests of ``num_tokens`` tokens each
    are live at once ("how much for N requests of length L"): the main group holds every
    request's whole context, the window-bounded groups their :func:`sliding_pool_blocks` for
    ``max_num_reqs = num_requests`` and a step budget of ``max_num_batched_tokens``. Passing
    the result as ``memory_bytes`` (with the same ``max_num_reqs`` and budget) gives exactly
    room for the N requests."""
    for name, v in (("num_requests", num_requests), ("num_tokens", num_tokens),
                    ("max_num_batched_tokens", max_num_batched_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    main = main_group(cfg)
    total = 0
    for g in cache_groups(cfg):
        if g.name == main.name and g.kind == "full":
            blocks = num_requests * cdiv(num_tokens, g.tokens_per_block)
        else:
            blocks = sliding_pool_blocks(g, num_requests, max_num_batched_tokens)
        total += blocks * g.page_bytes_per_block
    return total


def max_requests(cfg: CacheConfig, memory_bytes: int, num_tokens: int, max_num_batched_tokens: int = 1) -> int:
    """How many requests of ``num_tokens`` tokens fit at once in ``memory_bytes`` of cache (the
    largest N with ``memory_for_requests(N, ...) <= memory_bytes``; 0 if not even one)."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise ValueError(f"memory_bytes must be an int >= 0, got {memory_bytes!r}")
    fixed = memory_for_requests(cfg, 1, num_tokens, max_num_batched_tokens)
    per = memory_for_requests(cfg, 2, num_tokens, max_num_batched_tokens) - fixed  # cost of one more request
    if memory_bytes < fixed:
        return 0
    n = 1 + (memory_bytes - fixed) // per
    while n > 1 and memory_for_requests(cfg, n, num_tokens, max_num_batched_tokens) > memory_bytes:
        n -= 1
    return n
