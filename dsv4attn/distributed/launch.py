"""Process groups for tensor parallelism (TP) and decode context parallelism (DCP), and the
torchrun entry point.

``init_parallel(ParallelConfig(tp=..., dcp=...))`` joins the ``tp * dcp`` processes torchrun
started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: the standard
``env://`` rendezvous) and makes the groups: rank ``= dcp_rank * tp + tp_rank``, so a TP group is
``tp`` consecutive ranks (one host's fast links) and a DCP group takes one rank of each TP group.
NCCL on CUDA (device ``cuda:LOCAL_RANK``), gloo on CPU. :func:`make_runner` turns a full layer into
this rank's runner. Command line (every rank runs the parity check of the three layer kinds
against one process and rank 0 prints it)::

    torchrun --nproc-per-node 2 -m dsv4attn.distributed --tp 2 --check
    torchrun --nproc-per-node 2 -m dsv4attn.distributed --dcp 2 --check
    torchrun --nproc-per-node 4 -m dsv4attn.distributed --tp 2 --dcp 2 --check

A CLI that serves a model adds the flags with :func:`add_parallel_args` and calls
:func:`init_parallel` with :func:`parallel_config_from_args`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv4attn.distributed.dcp import DCPAttentionRunner
from dsv4attn.distributed.tp import shard_attention
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.runner import AttentionRunner


@dataclass(frozen=True)
class ParallelConfig:
    """``tp`` ranks share a layer's heads; ``dcp`` ranks share its caches by context (entries
    dealt in runs of ``dcp_interleave``). ``tp * dcp`` processes in all."""

    tp: int = 1
    dcp: int = 1
    dcp_interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "dcp_interleave"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dcp

    def check_layer(self, num_heads: int) -> None:
        """``ValueError`` unless ``tp`` divides ``num_heads``."""
        if num_heads % self.tp:
            raise ValueError(f"--tp {self.tp} must divide the number of attention heads ({num_heads})")


@dataclass(frozen=True)
class ParallelContext:
    """This process's place: global rank/size, device, and its TP and DCP groups (``None``
    when that size is 1)."""

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    tp_rank: int
    dcp_rank: int
    tp_group: Any = None
    dcp_group: Any = None


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v is not None else None


def init_parallel(
    config: ParallelConfig, *, rank: int | None = None, world_size: int | None = None,
    local_rank: int | None = None, init_method: str = "env://", backend: str | None = None,
    device: torch.device | str | None = None,
) -> ParallelContext:
    """Join the process group and build the TP/DCP groups (collective: every rank calls it).

    ``rank``/``world_size``/``local_rank`` default to torchrun's ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``; a single process without them and ``tp = dcp = 1`` needs no process group.
    ``backend``: ``"nccl"`` when CUDA is available, else ``"gloo"``; ``device``: ``cuda:local_rank``
    or ``cpu``. Raises ``ValueError`` when the process count differs from ``tp * dcp``.
    """
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a ParallelConfig, got {type(config).__name__}")
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    local_rank = (_env_int("LOCAL_RANK") if local_rank is None else local_rank)
    if world_size is None:
        world_size, rank = 1, 0
    if rank is None or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank} (torchrun sets RANK)")
    if world_size != config.world_size:
        raise ValueError(f"--tp {config.tp} x --dcp {config.dcp} needs {config.world_size} processes, "
                         f"but {world_size} were started (torchrun --nproc-per-node)")
    local_rank = rank if local_rank is None else local_rank
    if device is None:
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    tp, dcp = config.tp, config.dcp
    tp_rank, dcp_rank = rank % tp, rank // tp
    if world_size == 1:
        return ParallelContext(config, 0, 1, device, 0, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kw)
    tp_group = dcp_group = None
    for d in range(dcp):  # new_group is collective: every rank creates every group
        g = dist.new_group(list(range(d * tp, (d + 1) * tp))) if tp > 1 else None
        if d == dcp_rank:
            tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world_size, tp))) if dcp > 1 else None
        if t == tp_rank:
            dcp_group = g
    return ParallelContext(config, rank, world_size, device, tp_rank, dcp_rank, tp_group, dcp_group)


def make_runner(layer: DeepseekV4Attention, ctx: ParallelContext, **runner_kwargs: Any) -> Any:
    """This rank's runner of ``layer`` (full weights, on ``ctx.device``): TP shard when ``tp > 1``,
    DCP caches when ``dcp > 1``, else a plain ``AttentionRunner``. Keyword arguments go to the
    runner (those of ``AttentionRunner``)."""
    ctx.config.check_layer(layer.num_heads)
    if ctx.config.tp > 1:
        layer = shard_attention(layer, ctx.tp_group)
    if ctx.config.dcp > 1:
        return DCPAttentionRunner(layer, ctx.dcp_group, interleave=ctx.config.dcp_interleave, **runner_kwargs)
    return AttentionRunner(layer, **runner_kwargs)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """``--tp N``, ``--dcp N``, ``--dcp-interleave I`` (all default 1)."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks over the attention heads")
    parser.add_argument("--dcp", type=int, default=1, help="decode-context-parallel ranks over the KV caches")
    parser.add_argument("--dcp-interleave", type=int, default=1,
                        help="cache entries dealt to one DCP rank in a row (cp_kv_cache_interleave_size)")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp=args.tp, dcp=args.dcp, dcp_interleave=args.dcp_interleave)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m dsv4attn.distributed",
                                     description=__doc__.split("\n")[0])
    add_parallel_args(parser)
    parser.add_argument("--check", action="store_true", help="run the parity check (the default action)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--kinds", default="sliding,csa,hca", help="layer kinds to check (comma-separated)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda:LOCAL_RANK when CUDA is available (NCCL), else cpu (gloo)")
    args = parser.parse_args(argv)
    from dsv4attn.distributed.selfcheck import format_results, run_checks

    device: torch.device | str | None = None
    if args.device == "cpu":
        device = "cpu"
    elif args.device == "cuda":
        device = torch.device("cuda", _env_int("LOCAL_RANK") or 0)
    ctx = init_parallel(parallel_config_from_args(args), device=device)
    torch.manual_seed(0)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    results = run_checks(ctx, dtype=getattr(torch, args.dtype), kinds=kinds)
    if ctx.rank == 0:
        print(format_results(results, ctx))
    ok = all(r["ok"] for r in results.values())
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if ok else 1
