"""Cache memory accounting: bytes per group and per request, and the footprint of a context.

:func:`request_footprint` answers "how many cache bytes does one request of ``num_tokens``
tokens hold in this model?" from the specs alone (no allocation): full groups hold
``cdiv(num_tokens, tokens_per_block)`` blocks, sliding groups only the blocks still visible to
later tokens (the allocator's state after ``advance``). :func:`dense_mla_bytes` gives the
comparison point: one 584 B (fp8_ds_mla) or 1024 B (bf16) entry per token per layer.
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
    for label, b in (("dense MLA fp8_ds_mla (584 B)", DENSE_FP8_DS_MLA_BYTES), ("dense MLA bf16 (1024 B)", DENSE_BF16_BYTES)):
        lines.append(f"| {label} | " + " | ".join(
            f"{dense_mla_bytes(cfg.num_layers, n, b) / gib:.3f} GiB" for n in contexts) + " |")
    return "\n".join(lines)
