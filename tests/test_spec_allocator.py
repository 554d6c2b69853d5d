"""Allocator side of speculative decoding: rollback and commit against a naive model.

A manager with ``rollback_tokens = k`` must (1) keep, in every sliding group, exactly the
columns a token at the rollback floor can read (floor = highest ``computed - k`` seen, or the
last commit), (2) after ``rollback(n)`` look exactly like a request grown and advanced to ``n``
with the same floor (same columns live, trailing blocks back in the pool), (3) never hold more
than the pool sizing assumes (``sliding_pool_blocks(..., rollback_tokens=k)``), and (4) refuse
bad calls without changing anything. Hypothesis interleaves grow / advance / rollback / commit
/ free over several requests.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.kv_cache.accounting import sliding_pool_blocks
from dsv4attn.kv_cache.allocator import NULL_BLOCK, KVCacheManager, cdiv

GROUPS_ARGS = [("full", "full", 8, None), ("swa", "sliding", 4, 8), ("state", "sliding", 2, 3),
               ("wide", "sliding", 4, 16)]


def _groups():
    from dsv4attn.kv_cache.specs import GroupSpec

    return [GroupSpec(n, kind, tokens_per_block=tpb, window=w) for n, kind, tpb, w in GROUPS_ARGS]


def _snapshot(m):
    return (copy.deepcopy(m._tables), dict(m._num_tokens), dict(m._num_computed), dict(m._floor),
            sorted(m.pool._free))


def _check(m: KVCacheManager, model: dict) -> None:
    """model: request -> (num_tokens, num_computed, floor) tracked independently of the manager."""
    owned = []
    for r in m.requests:
        n, c, f = model[r]
        assert (m.num_tokens(r), m.num_computed(r), m.rollback_floor(r)) == (n, c, f)
        assert c - f <= m.rollback_tokens or f == c
        for g in m.groups:
            table = m.block_ids(r, g.name)
            assert len(table) == cdiv(n, g.tokens_per_block)
            first = 0 if g.kind == "full" else max(0, f - g.window + 1) // g.tokens_per_block
            assert [b != NULL_BLOCK for b in table] == [i >= first for i in range(len(table))]
            if g.kind == "sliding":  # what one request may hold under the pool sizing
                assert m.num_held(r, g.name) <= cdiv(g.window - 1 + m.rollback_tokens + (n - c),
                                                     g.tokens_per_block) + 1
            owned += [b for b in table if b != NULL_BLOCK]
    assert len(owned) == len(set(owned)) and not set(owned) & set(m.pool._free)
    assert sorted(owned + m.pool._free) == list(range(m.pool.num_blocks)), "leak"


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "advance", "rollback", "commit", "free"]),
                         st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=80)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(0, 4), program=ops)
def test_rollback_commit_interleavings(k, program):
    m = KVCacheManager(_groups(), 400, rollback_tokens=k)
    model: dict = {}
    for op, req, amount in program:
        if op == "add":
            if req not in m:
                m.add_request(req, amount)
                model[req] = (amount, 0, 0)
        elif req not in m:
            continue
        elif op == "grow":
            n, c, f = model[req]
            m.grow(req, n + amount)
            model[req] = (n + amount, c, f)
        elif op == "advance":
            n, c, f = model[req]
            c2 = c + (n - c) * amount // 12
            m.advance(req, c2)
            model[req] = (n, c2, max(f, c2 - k))
        elif op == "rollback":
            n, c, f = model[req]
            target = c - amount
            before = _snapshot(m)
            if not f <= target <= c:
                with pytest.raises(ValueError, match="rollback floor" if target >= 0 else ">= 0"):
                    m.rollback(req, target)
                assert _snapshot(m) == before
                continue
            held = m.num_held(req)
            freed = m.rollback(req, target)
            assert freed == held - m.num_held(req)
            model[req] = (target, target, f)
        elif op == "commit":
            n, c, f = model[req]
            m.commit(req)
            model[req] = (n, c, max(f, c))
        else:
            m.free(req)
            del model[req]
        _check(m, model)
    for r in m.requests:
        m.free(r)
    assert m.pool.num_free == 400


def test_rollback_equals_never_appended():
    """Grow + advance by 5, roll back 3, commit: the tables are those of growing by 2 and
    committing (column pattern and held counts), and the undone columns' blocks are back in
    the pool. (Before the commit the floors differ, 31 vs 30: a floor never goes down, which
    only limits how far a later rollback may go.)"""
    a = KVCacheManager(_groups(), 200, rollback_tokens=4)
    b = KVCacheManager(_groups(), 200, rollback_tokens=4)
    for m in (a, b):
        m.add_request("r", 30)
        m.advance("r", 30)
        m.commit("r")
    a.grow("r", 35)
    a.advance("r", 35)
    assert a.rollback_floor("r") == 31
    assert a.rollback("r", 32) == 1 + 1 + 2 + 1  # columns past positions 0..31: full, swa, state, wide
    b.grow("r", 32)
    b.advance("r", 32)
    for m in (a, b):
        m.commit("r")
    for g in ("full", "swa", "state", "wide"):
        assert [x == NULL_BLOCK for x in a.block_ids("r", g)] == [x == NULL_BLOCK for x in b.block_ids("r", g)]
        assert a.num_held("r", g) == b.num_held("r", g)
    assert a.pool.num_free == b.pool.num_free
    assert (a.num_tokens("r"), a.num_computed("r"), a.rollback_floor("r")) == (32, 32, 32)


def test_sliding_blocks_are_kept_for_rollback():
    """Window 8, 4 positions per block, k = 4: after advancing to 17 a plain manager keeps what
    token 17 reads (10..17: columns 2..), a k = 4 manager what a token at the floor 13 reads
    (6..13: columns 1..), so rolling back to 13 needs no block that was given back."""
    from dsv4attn.kv_cache.specs import GroupSpec

    g = [GroupSpec("swa", "sliding", tokens_per_block=4, window=8)]
    plain, spec = KVCacheManager(g, 20), KVCacheManager(g, 20, rollback_tokens=4)
    for m in (plain, spec):
        m.add_request("r", 17)
        m.advance("r", 17)
    assert plain.block_ids("r", "swa")[:3] == [NULL_BLOCK, NULL_BLOCK, 2]  # 17 reads 10..17
    assert spec.block_ids("r", "swa")[:3] == [NULL_BLOCK, 1, 2]  # floor 13 reads 6..13
    spec.rollback("r", 13)
    assert spec.block_ids("r", "swa") == [NULL_BLOCK, 1, 2, 3]
    with pytest.raises(ValueError, match="rollback floor"):
        spec.rollback("r", 12)
    with pytest.raises(ValueError, match="rollback floor"):
        plain.rollback("r", 16)  # k = 0: nothing can be taken back
    spec.commit("r")
    assert spec.block_ids("r", "swa") == [NULL_BLOCK, 1, 2, 3]  # 13 still reads 6..13
    spec.grow("r", 16)
    spec.advance("r", 16)
    spec.commit("r")
    assert spec.block_ids("r", "swa") == [NULL_BLOCK, NULL_BLOCK, 2, 3]


def test_pool_sizing_covers_rollback_headroom():
    from dsv4attn.kv_cache.specs import GroupSpec

    g = GroupSpec("swa", "sliding", tokens_per_block=4, window=8)
    for k in range(5):
        m = KVCacheManager([g], 10_000, rollback_tokens=k)
        reqs, step = 6, 5
        for r in range(reqs):
            m.add_request(r, 0)
        for t in range(0, 60, step):  # every request decodes step tokens per step, never commits
            for r in range(reqs):
                m.grow(r, t + step)
            held = 10_000 - m.pool.num_free
            assert held <= sliding_pool_blocks(g, reqs, reqs * step, rollback_tokens=k)
            for r in range(reqs):
                m.advance(r, t + step)
    assert sliding_pool_blocks(g, 1, 1, rollback_tokens=4) > sliding_pool_blocks(g, 1, 1)


def test_bad_rollback_and_commit_calls():
    m = KVCacheManager(_groups(), 50, rollback_tokens=2)
    m.add_request("a", 6)
    m.advance("a", 6)
    before = _snapshot(m)
    for bad in (-1, 7, 3, True, 2.0):
        with pytest.raises((ValueError, TypeError)):
            m.rollback("a", bad)
        assert _snapshot(m) == before
    with pytest.raises(KeyError):
        m.rollback("zz", 0)
    with pytest.raises(ValueError):
        m.commit("a", 7)
    with pytest.raises(ValueError):
        KVCacheManager(_groups(), 5, rollback_tokens=-1)
    assert _snapshot(m) == before
