"""Several processes per layer over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

- :mod:`~dsv4attn.distributed.tp`: tensor parallelism over the query heads (``TPAttention``,
  ``shard_attention``, ``TPAttentionRunner``); one all-reduce after the output projection.
- :mod:`~dsv4attn.distributed.dcp`: decode context parallelism (``DCPAttentionRunner``): caches
  sharded by context, partial attention merged by log-sum-exp, the sink applied once.
- :mod:`~dsv4attn.distributed.dcp_step`: the DCP step of any layer (``build_dcp_metadata`` once
  per step, ``dcp_layer_step`` per layer): what a whole-model DCP path calls.
- :mod:`~dsv4attn.distributed.interleave`: which rank holds which cache entry; the lse merge.
- :mod:`~dsv4attn.distributed.launch`: process groups from torchrun (``init_parallel``,
  ``make_runner``, ``--tp``/``--dcp`` flags); ``torchrun ... -m dsv4attn.distributed --check``.
"""

from dsv4attn.distributed.dcp import DCPAttentionRunner
from dsv4attn.distributed.dcp_step import DCPStepMetadata, build_dcp_metadata, dcp_layer_step
from dsv4attn.distributed.launch import (
    ParallelConfig,
    ParallelContext,
    add_parallel_args,
    init_parallel,
    make_runner,
    parallel_config_from_args,
)
from dsv4attn.distributed.tp import TPAttention, TPAttentionRunner, shard_attention, tp_head_range

__all__ = [
    "DCPAttentionRunner",
    "DCPStepMetadata",
    "ParallelConfig",
    "ParallelContext",
    "TPAttention",
    "TPAttentionRunner",
    "add_parallel_args",
    "build_dcp_metadata",
    "dcp_layer_step",
    "init_parallel",
    "make_runner",
    "parallel_config_from_args",
    "shard_attention",
    "tp_head_range",
]
