"""The arithmetic of TP and DCP in one process (no communication) and the refused configurations.

- TP: the shards' partial outputs (``shard_attention(..., rank, world_size)`` without a group)
  sum to the full layer's dense output, for head/group splits that give whole groups, groups cut
  between ranks, and uneven segments (6 heads in 3 groups over 2 ranks).
- DCP placement: ``owner`` / ``global_to_local`` / ``num_local`` / ``max_local`` against a
  plain-Python dealing of entries, and against ``get_compressed_slot_mapping`` with the CP
  arguments (the engine's slots).
"""

import random

import pytest
import torch

from dsv4attn.distributed import (
    DCPAttentionRunner,
    ParallelConfig,
    TPAttentionRunner,
    init_parallel,
    shard_attention,
    tp_head_range,
)
from dsv4attn.distributed.interleave import global_to_local, local_to_global, max_local, num_local, owner
from dsv4attn.distributed.selfcheck import random_layer, small_config
from dsv4attn.distributed.tp import output_segments
from dsv4attn.ops.metadata import get_compressed_slot_mapping


@pytest.mark.parametrize("num_heads,o_groups,world", [(4, 2, 2), (4, 2, 4), (4, 1, 2), (4, 4, 2), (6, 3, 2),
                                                     (6, 2, 3), (12, 3, 4), (12, 4, 6)])
@pytest.mark.parametrize("layer_idx", [0, 1])
def test_tp_partial_outputs_sum_to_the_layer(num_heads, o_groups, world, layer_idx):
    cfg = small_config(num_heads, o_groups)
    layer = random_layer(cfg, layer_idx, seed=num_heads * 10 + world)
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x)
        shards = [shard_attention(layer, rank=r, world_size=world) for r in range(world)]
        got = sum(s(x) for s in shards)
    assert [s.head_range for s in shards] == [tp_head_range(num_heads, world, r) for r in range(world)]
    assert sum(s.num_heads for s in shards) == num_heads
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_tp_segments():
    # 6 heads, 3 groups of 2, 2 ranks of 3: rank 0 has group 0 whole and head 2 of group 1
    assert output_segments(6, 3, 0, 3) == [(0, 0, 2), (1, 2, 3)]
    assert output_segments(6, 3, 3, 6) == [(1, 3, 4), (2, 4, 6)]
    assert output_segments(8, 2, 2, 4) == [(0, 2, 4)]  # a quarter of a group
    assert output_segments(8, 4, 0, 4) == [(0, 0, 2), (1, 2, 4)]  # whole groups


def test_tp_refuses_bad_configurations():
    layer = random_layer(small_config(), 0)
    with pytest.raises(ValueError, match="num_heads=4"):
        tp_head_range(4, 3, 0)
    with pytest.raises(ValueError, match="num_heads=4"):
        shard_attention(layer, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        shard_attention(layer, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank and world_size"):
        shard_attention(layer)
    with pytest.raises(TypeError, match="already"):
        shard_attention(shard_attention(layer, rank=0, world_size=2), rank=0, world_size=2)
    with pytest.raises(ValueError, match="process group"):
        TPAttentionRunner(layer)
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        ParallelConfig(tp=3).check_layer(4)


def test_dcp_and_launch_refuse_bad_configurations():
    layer = random_layer(small_config(), 1)
    with pytest.raises(ValueError, match="interleave"):
        DCPAttentionRunner(layer, interleave=0)
    with pytest.raises(ValueError, match="process group"):
        DCPAttentionRunner(layer)
    for bad in (dict(tp=0), dict(dcp=-1), dict(dcp_interleave=0), dict(tp=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ParallelConfig(**bad)
    with pytest.raises(ValueError, match="needs 4 processes, but 2"):
        init_parallel(ParallelConfig(tp=2, dcp=2), rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank must be in"):
        init_parallel(ParallelConfig(tp=2), rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        num_local(5, 2, 2, 1)
    single = init_parallel(ParallelConfig(), rank=0, world_size=1, device="cpu")
    assert (single.world_size, single.tp_group, single.dcp_group) == (1, None, None)


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 5)])
def test_interleave_placement_matches_plain_dealing(world, interleave):
    n = 97
    dealt = {r: [] for r in range(world)}  # deal entries 0..n-1 in runs of `interleave`
    for e in range(n):
        dealt[(e // interleave) % world].append(e)
    e = torch.arange(n)
    for r in range(world):
        mine = dealt[r]
        assert (owner(e, world, interleave) == r).nonzero().flatten().tolist() == mine
        local = global_to_local(torch.tensor(mine, dtype=torch.int64), world, interleave)
        assert local.tolist() == list(range(len(mine)))
        assert local_to_global(local, r, world, interleave).tolist() == mine
        for m in range(n + 1):
            assert num_local(m, r, world, interleave) == sum(1 for x in mine if x < m)
        assert num_local(e, r, world, interleave).tolist() == [num_local(m, r, world, interleave) for m in range(n)]
    for m in range(1, 40):
        windows = [sum(1 for x in dealt[r] if a <= x < a + m) for r in range(world) for a in range(n - m)]
        assert max_local(m, world, interleave) == max(windows)


@pytest.mark.parametrize("ratio,block_size", [(1, 64), (4, 64), (128, 2)])
@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 3), (3, 2)])
def test_interleave_placement_matches_compressed_slot_mapping(ratio, block_size, world, interleave):
    if block_size % interleave:
        pytest.skip("the engine's formula deals within blocks: equal only when the interleave divides the block")
    rng = random.Random(ratio + world)
    qlens = [1, 5, 130, 1, 37]
    seq_lens = [q + rng.randint(0, 600) for q in qlens]
    cols = 40
    table = torch.randperm(len(qlens) * cols, generator=torch.Generator().manual_seed(2)).int().view(len(qlens), cols)
    qsl = torch.tensor([0] + qlens).cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    T = sum(qlens)
    for rank in range(world):
        got = get_compressed_slot_mapping(T, qsl, sl, table, block_size, ratio, cp_world_size=world, cp_rank=rank,
                                          cp_kv_cache_interleave_size=interleave, impl="reference")
        want = []
        for q, (n, s) in enumerate(zip(qlens, seq_lens)):
            for p in range(s - n, s):
                if (p + 1) % ratio:
                    want.append(-1)
                    continue
                k = torch.tensor((p + 1) // ratio - 1)
                if int(owner(k, world, interleave)) != rank:
                    want.append(-1)
                    continue
                L = int(global_to_local(k, world, interleave))
                want.append(int(table[q, L // block_size]) * block_size + L % block_size)
        assert got.tolist() == want


def test_dcp_refuses_an_interleave_that_does_not_divide_a_block(tmp_path):
    """The engine's slot formula deals entries within blocks; an interleave that does not divide
    a split cache's block size (C128A stores 2 entries per block) is refused up front."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="interleave=3 must divide"):
            DCPAttentionRunner(random_layer(small_config(), 2), interleave=3)  # HCA: 2 entries per block
        DCPAttentionRunner(random_layer(small_config(), 2), interleave=2)
    finally:
        dist.destroy_process_group()


def test_runners_refuse_bad_chunks_by_name_before_any_change(tmp_path):
    """AttentionRunner and DCPAttentionRunner share one chunk check (serving.runner.check_chunks):
    each bad step raises naming the request, and the runners' pools are untouched."""
    import torch.distributed as dist

    from dsv4attn.serving.runner import AttentionRunner

    layer = random_layer(small_config(), 1)
    hs = layer.config.hidden_size
    bad = [(["not a dict"], TypeError, "chunks must be a dict"),
           ({"a": [1.0]}, TypeError, r"chunks\['a'\] must be a torch.Tensor"),
           ({"a": torch.zeros(2, hs + 1)}, ValueError, r"chunks\['a'\] must be \[n, "),
           ({"a": torch.zeros(0, hs)}, ValueError, r"chunks\['a'\] is empty"),
           ({"a": torch.zeros(2, hs, dtype=torch.float64)}, ValueError, r"chunks\['a'\] must be torch.float32")]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        runners = [AttentionRunner(layer, num_blocks=16, max_model_len=64, max_num_batched_tokens=32, max_num_reqs=2),
                   DCPAttentionRunner(layer, num_blocks=16, max_model_len=64, max_num_batched_tokens=32, max_num_reqs=2)]
        def free_blocks(runner):
            if isinstance(runner, DCPAttentionRunner):
                return {name: m.pool.num_free for name, m in runner.managers.items()}
            return {g: runner.engine.num_free_blocks(g) for g in runner.engine.num_blocks}

        for runner in runners:
            before = free_blocks(runner)
            for chunks, err, match in bad:
                with pytest.raises(err, match=match):
                    runner.step(chunks)
            assert free_blocks(runner) == before
    finally:
        dist.destroy_process_group()
