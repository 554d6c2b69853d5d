"""Where a cache entry lives under decode context parallelism (DCP), and how partial
attention results merge.

Entries of a request's stream (SWA: one per raw position; compressed: one per ``r`` positions)
are dealt to the ``world`` ranks in chunks of ``interleave`` (``I``), exactly as
``get_compressed_slot_mapping`` does with its CP arguments:

- entry ``e`` lives on rank ``(e // I) % world``,
- at rank-local entry index ``L = (e // (I * world)) * I + e % I``,
- stored at ``block_table[req, L // block_size] * block_size + L % block_size`` (the rank's table).

Local indices enumerate a rank's entries in increasing global order, so the entries of a global
range ``[a, b)`` held by a rank are the local range ``[num_local(a), num_local(b))``: range-form
candidate sets (SWA window, C128A prefix) stay range-form on every rank.

Merge: rank ``i`` returns ``out_i`` (softmax over its own candidates, no sink) and the natural-log
``lse_i``. With ``lse = log sum_i exp(lse_i)`` the full result is
``sum_i exp(lse_i - lse) * out_i``, times the sink factor ``1 / (1 + exp(sink - lse))``.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.distributed as dist


def _check(world_size: int, rank: int, interleave: int) -> None:
    for name, v in (("world_size", world_size), ("interleave", interleave)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def owner(entry: torch.Tensor, world_size: int, interleave: int) -> torch.Tensor:
    """Rank holding global entries ``entry [...]`` (int tensor, >= 0)."""
    return torch.div(entry, interleave, rounding_mode="floor") % world_size


def global_to_local(entry: torch.Tensor, world_size: int, interleave: int) -> torch.Tensor:
    """Rank-local index of global entries ``entry [...]`` on their owner rank."""
    return torch.div(entry, interleave * world_size, rounding_mode="floor") * interleave + entry % interleave


def local_to_global(local: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor:
    """Global entry of ``rank``'s local indices ``local [...]``."""
    return (torch.div(local, interleave, rounding_mode="floor") * interleave * world_size
            + rank * interleave + local % interleave)


@overload
def num_local(n: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor: ...
@overload
def num_local(n: int, rank: int, world_size: int, interleave: int) -> int: ...
def num_local(n: torch.Tensor | int, rank: int, world_size: int, interleave: int) -> torch.Tensor | int:
    """How many of the global entries ``0 .. n-1`` live on ``rank`` (elementwise for a tensor)."""
    _check(world_size, rank, interleave)
    period = interleave * world_size
    full: torch.Tensor | int
    if isinstance(n, torch.Tensor):
        full = torch.div(n, period, rounding_mode="floor")
        return full * interleave + (n - full * period - rank * interleave).clamp(0, interleave)
    full = n // period
    return full * interleave + min(max(n - full * period - rank * interleave, 0), interleave)


def max_local(m: int, world_size: int, interleave: int) -> int:
    """The most entries one rank holds among any ``m`` consecutive entries."""
    period = interleave * world_size
    return m // period * interleave + min(m % period, interleave)


def merge_scale(lse: torch.Tensor, sinks: torch.Tensor | None, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's weight in the merged output: fp32 ``[T, H]``.

    lse fp32 ``[T, H]``: the natural-log logsumexp of the rank's own candidates as the attention
    op returns it (``+inf`` for a token with none); sinks fp32 ``[H]`` or ``None``. All-gathers
    the lse over ``group`` and returns ``exp(lse_i - lse) / (1 + exp(sink - lse))`` (0 where the
    rank has no candidate; 0 everywhere for a token no rank has a candidate for, as one process
    gives 0 then). ``sum_i scale_i * out_i`` is the single-process output.
    """
    mine = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse).float().contiguous()
    world = dist.get_world_size(group)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    every = torch.stack(parts)  # [world, T, H]
    m = every.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = m + torch.log(torch.exp(every - m).sum(dim=0))  # -inf where no rank has a candidate
    scale = torch.where(torch.isneginf(mine), torch.zeros_like(mine), torch.exp(mine - total))
    if sinks is not None:
        scale = scale / (1.0 + torch.exp(sinks.float()[None, :] - total))
    return scale
