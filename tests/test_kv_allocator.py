"""Block allocator: hypothesis interleavings of add / grow / advance / free over many requests
checked against a naive model of what each table must hold."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.kv_cache.accounting import blocks_held, manager_bytes, request_footprint
from dsv4attn.kv_cache.allocator import NULL_BLOCK, KVCacheManager, PoolExhaustedError, sliding_blocks_bound
from dsv4attn.kv_cache.specs import CacheConfig, GroupSpec, cache_groups

GROUPS = [
    GroupSpec("full", "full", tokens_per_block=8),
    GroupSpec("swa", "sliding", tokens_per_block=4, window=8),
    GroupSpec("state", "sliding", tokens_per_block=2, window=3),
    GroupSpec("wide", "sliding", tokens_per_block=4, window=16),
]


def snapshot(m: KVCacheManager):
    return (copy.deepcopy(m._tables), dict(m._num_tokens), dict(m._num_computed), sorted(m.pool._free))


def check_invariants(m: KVCacheManager) -> None:
    owned = []
    for r in m.requests:
        n, c = m.num_tokens(r), m.num_computed(r)
        for g in m.groups:
            table = m.block_ids(r, g.name)
            assert len(table) == -(-n // g.tokens_per_block)
            first = 0 if g.kind == "full" else max(0, c - g.window + 1) // g.tokens_per_block
            # Exactly the still-visible columns hold blocks; freed columns keep their place.
            assert [b != NULL_BLOCK for b in table] == [i >= first for i in range(len(table))]
            if g.kind == "sliding":
                assert m.num_held(r, g.name) <= sliding_blocks_bound(g, n - c)
            assert m.num_held(r, g.name) == blocks_held(g, c, n - c)
            owned += [b for b in table if b != NULL_BLOCK]
        # the cached coverage answers as the tables do (one past the allocation included)
        for t in (n, n + 1, n + 5):
            assert m.covers(r, t) == all(len(m.block_ids(r, g.name)) >= -(-t // g.tokens_per_block) for g in m.groups)
    free = m.pool._free
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not set(owned) & set(free), "an owned block is also free"
    assert len(free) == len(set(free))
    assert sorted(owned + free) == list(range(m.pool.num_blocks)), "leak"


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "advance", "free"]), st.integers(0, 7), st.integers(0, 40)),
    min_size=1, max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(0, 60), program=ops)
def test_random_interleavings_keep_invariants(num_blocks, program):
    m = KVCacheManager(GROUPS, num_blocks)
    for op, req, amount in program:
        before = snapshot(m)
        try:
            if op == "add":
                if req in m:
                    with pytest.raises(ValueError):
                        m.add_request(req, amount)
                    continue
                m.add_request(req, amount)
            elif req not in m:
                continue
            elif op == "grow":
                m.grow(req, m.num_tokens(req) + amount)
            elif op == "advance":
                c, n = m.num_computed(req), m.num_tokens(req)
                m.advance(req, c + (n - c) * amount // 40)
            else:
                freed = m.free(req)
                assert freed == sum(1 for g in before[0][req].values() for b in g if b != NULL_BLOCK)
        except PoolExhaustedError:
            assert snapshot(m) == before, "a failed allocation changed state"
            need = m.blocks_needed(req if req in m else None, (m.num_tokens(req) if req in m else 0) + amount)
            assert need > m.pool.num_free
        check_invariants(m)
    for r in m.requests:
        m.free(r)
    assert m.pool.num_free == num_blocks


def test_sliding_window_releases_and_keeps_columns():
    m = KVCacheManager([GroupSpec("swa", "sliding", tokens_per_block=64, window=128)], 10)
    m.add_request("a", 300)  # columns 0..4
    assert m.block_ids("a", "swa") == [0, 1, 2, 3, 4]
    assert m.advance("a", 300) == 2  # next token 300 sees 173..300: columns 2.. remain
    assert m.block_ids("a", "swa") == [NULL_BLOCK, NULL_BLOCK, 2, 3, 4]
    m.grow("a", 301)  # still column 4
    m.advance("a", 301)
    m.grow("a", 400)  # columns 5, 6 get recycled ids
    assert m.block_ids("a", "swa")[5:] == [0, 1]
    bt = m.block_table(["a"], "swa", width=9)
    assert bt.dtype == torch.int32 and bt.tolist() == [[-1, -1, 2, 3, 4, 0, 1, -1, -1]]
    with pytest.raises(ValueError, match="width"):
        m.block_table(["a"], "swa", width=3)
    assert m.free("a") == 5 and m.pool.num_free == 10


@pytest.mark.parametrize("tokens", [[5, 0, 40, 17, 300], [700, 650, 3]])  # short rows: scatter; long: per row
def test_block_table_matches_the_per_row_lists(tokens):
    """The exported table (both write paths, with and without ``out``) holds each request's
    block list, NULL_BLOCK in reclaimed columns and past the row, rows in the order asked."""
    groups = [GroupSpec("full", "full", tokens_per_block=2), GroupSpec("swa", "sliding", tokens_per_block=4, window=8)]
    m = KVCacheManager(groups, 4000)
    for r, n in enumerate(tokens):
        m.add_request(r, n)
        m.advance(r, n)  # sliding columns below the window are reclaimed
    order = list(reversed(range(len(tokens))))
    for g in ("full", "swa"):
        want = [m.block_ids(r, g) for r in order]
        width = max(map(len, want)) + 3
        expect = [row + [NULL_BLOCK] * (width - len(row)) for row in want]
        assert m.block_table(order, g, width=width).tolist() == expect
        out = torch.full((len(order), width), 123, dtype=torch.int32)
        assert m.block_table(order, g, out=out) is out and out.tolist() == expect
    with pytest.raises(ValueError, match="out must be"):
        m.block_table(order, "full", out=torch.zeros(len(order), 400, dtype=torch.int64))
    with pytest.raises(ValueError, match="width"):
        m.block_table(order, "full", out=torch.zeros(len(order), 1, dtype=torch.int32))


@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(0, 900), min_size=1, max_size=12), data=st.data())
def test_windowed_block_table_is_the_row_from_first_cols_on(tokens, data):
    """``first_cols``: row i is the request's list from column ``first_cols[i]`` on (both write
    paths, short and long rows), NULL_BLOCK past it; bad ``first_cols`` raise ValueError naming
    it and change nothing."""
    groups = [GroupSpec("full", "full", tokens_per_block=2), GroupSpec("state", "sliding", tokens_per_block=2,
                                                                       window=9)]
    m = KVCacheManager(groups, 20000)
    advance = data.draw(st.booleans())  # reclaimed rows: few live columns (scatter); else long rows (slices)
    for r, n in enumerate(tokens):
        m.add_request(r, n)
        if advance:
            m.advance(r, n)
    order = list(range(len(tokens)))
    firsts = [data.draw(st.integers(0, len(m.block_ids(r, "state")) + 2)) for r in order]
    want = [m.block_ids(r, "state")[f:] for r, f in zip(order, firsts)]
    width = max(map(len, want), default=0) + 1
    got = m.block_table(order, "state", width=width, first_cols=firsts)
    assert got.tolist() == [row + [NULL_BLOCK] * (width - len(row)) for row in want]
    before = [m.block_ids(r, "state") for r in order]
    for bad, msg in (([0] * (len(order) + 1), "first_cols has"), ([-1] + [0] * (len(order) - 1), "first_cols")):
        with pytest.raises(ValueError, match=msg):
            m.block_table(order, "state", first_cols=bad)
    with pytest.raises(ValueError, match="first_cols is for sliding groups"):
        m.block_table(order, "full", first_cols=[0] * len(order))
    assert [m.block_ids(r, "state") for r in order] == before


def test_covers_says_whether_a_grow_takes_blocks():
    """``covers(req, n)``: every group already has the columns for n tokens, i.e. a grow to n
    takes nothing from the pools (the fast path of grow and of the engine's step check)."""
    m = KVCacheManager(GROUPS, 64)
    m.add_request("a", 7)  # full: 1 column of 8, swa: 2 of 4, state: 4 of 2, wide: 2 of 4
    assert m.covers("a", 8) and m.covers("a", 7) and not m.covers("a", 9)
    for n in (8, 9, 17):
        free = m.pool.num_free
        takes = m.blocks_needed("a", n)
        assert (takes == 0) == m.covers("a", n)
        m.grow("a", n)
        assert free - m.pool.num_free == takes
    with pytest.raises(KeyError):
        m.covers("b", 1)
    with pytest.raises(ValueError, match="num_tokens"):
        m.covers("a", -1)


def test_exhaustion_is_all_or_nothing_across_groups():
    m = KVCacheManager(GROUPS, 12)
    m.add_request("a", 8)  # full 1 + swa 2 + state 4 + wide 2 = 9 blocks
    held = m.num_held("a")
    assert held == 9
    with pytest.raises(PoolExhaustedError, match="needs"):
        m.add_request("b", 5)  # 1 + 2 + 3 + 2 = 8 > 3 free, although "full" alone would fit
    assert "b" not in m and m.pool.num_free == 12 - held
    with pytest.raises(PoolExhaustedError):
        m.grow("a", 64)
    assert m.num_tokens("a") == 8 and m.num_held("a") == held


def test_bad_calls():
    m = KVCacheManager(GROUPS, 8)
    m.add_request("a", 4)
    with pytest.raises(ValueError):
        m.grow("a", 3)
    with pytest.raises(ValueError):
        m.advance("a", 5)
    with pytest.raises(KeyError):
        m.free("zz")
    with pytest.raises(ValueError, match="group"):
        m.block_ids("a", "nope")
    with pytest.raises(ValueError):
        KVCacheManager([GroupSpec("s", "sliding", 4, None)], 4)


def test_manager_matches_accounting_for_a_model():
    """A small C4A/C128A model: the manager's held bytes equal request_footprint's."""
    cfg = CacheConfig(compress_ratios=(0, 4, 128, 4), head_dim=128, rope_dim=64, index_head_dim=32)
    groups = cache_groups(cfg)
    assert [g.name for g in groups] == ["full_mla", "swa", "c4_state", "c128_state"]
    m = KVCacheManager(groups, 10_000)
    for n in (1, 7, 129, 1000, 4097):
        m.add_request(n, n)
        m.advance(n, n)
        fp = request_footprint(cfg, n)
        assert manager_bytes(m, n) == {g.group: g.bytes for g in fp.groups}


# ---- hardening: the pool refuses what it does not own ------------------------------------------
def test_pool_refuses_negative_double_and_foreign_give_backs():
    from dsv4attn.kv_cache.allocator import BlockPool

    p = BlockPool(4)
    with pytest.raises(ValueError, match="n must be"):
        p.take(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-2)
    ids = p.take(2)
    p.give_back(ids[:1])
    for bad in ([ids[0]], [ids[1], ids[1]], [7], [-1], [3]):  # twice, duplicate, foreign, never handed out
        with pytest.raises(ValueError):
            p.give_back(bad)
        assert p.num_free == 3
    with pytest.raises(TypeError):
        p.give_back(["1"])
    p.give_back(ids[1:])
    assert p.num_free == 4 and sorted(p._free) == [0, 1, 2, 3]


def test_manager_refuses_none_ids_and_negative_counts():
    m = KVCacheManager(GROUPS, 8)
    with pytest.raises(ValueError, match="None"):
        m.add_request(None, 3)
    with pytest.raises(TypeError, match="hashable"):
        m.add_request(["list"], 3)
    with pytest.raises(ValueError, match="num_tokens"):
        m.add_request("a", -1)
    m.add_request("a", 4)
    with pytest.raises(ValueError, match="num_tokens"):
        m.grow("a", -5)
    with pytest.raises(ValueError, match="num_computed"):
        m.advance("a", -1)
    assert m.requests == ["a"] and m.num_tokens("a") == 4 and m.pool.num_free + m.num_held("a") == 8


def test_per_group_pools_and_truncate():
    m = KVCacheManager(GROUPS, {"full": 2, "swa": 3, "state": 8, "wide": 5})
    assert not m.shared_pool
    with pytest.raises(ValueError, match="one pool per group"):
        _ = m.pool
    m.add_request("a", 8)
    assert {g: m.num_held("a", g) for g in ("full", "swa", "state", "wide")} == {"full": 1, "swa": 2, "state": 4,
                                                                             "wide": 2}
    with pytest.raises(PoolExhaustedError, match="'swa'"):  # full would fit; swa (3 blocks) not
        m.grow("a", 16)
    assert m.num_tokens("a") == 8
    m.advance("a", 8)
    m.grow("a", 12)
    held = m.num_held("a")
    freed = m.truncate("a", 9)  # undo the grow down to 9 tokens: as if grown to 9 only
    assert freed > 0 and m.num_held("a") == held - freed and m.num_tokens("a") == 9
    for g in m.groups:
        assert m.num_held("a", g.name) == blocks_held(g, 8, 1)
    with pytest.raises(ValueError):
        m.truncate("a", 7)  # below the computed count
    m.free("a")
    assert {g: p.num_free for g, p in m.pools.items()} == {"full": 2, "swa": 3, "state": 8, "wide": 5}
    with pytest.raises(ValueError, match="name exactly"):
        KVCacheManager(GROUPS, {"full": 2})
