"""BatchMetadata: derived fields vs loops, the decode/prefill split, and every validation error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4attn.metadata import BatchMetadata, split_decodes_and_prefills


def tables(num_reqs: int, cols: int = 64, device="cpu"):
    bt = torch.arange(num_reqs * cols, dtype=torch.int32, device=device).view(num_reqs, cols)
    return {"swa": bt, "full_mla": bt}


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 300)), max_size=8),
    spec=st.integers(0, 3),
    uniform=st.booleans(),
)
def test_from_requests_fields_match_loops(reqs, spec, uniform):
    # Order decodes first (by the threshold), as the engine does.
    thr = 1 + spec
    reqs = sorted(reqs, key=lambda r: r[0] > thr)
    ql = [q for q, _ in reqs]
    sl = [q + c for q, c in reqs]
    b = BatchMetadata.from_requests(ql, sl, tables(len(reqs)), num_speculative_tokens=spec, require_uniform=uniform)
    pos, t2r = [], []
    for i, (q, s) in enumerate(zip(ql, sl)):
        pos += [s - q + j for j in range(q)]
        t2r += [i] * q
    assert b.positions.tolist() == pos and b.token_to_req.tolist() == t2r
    assert b.positions.dtype == torch.int64 and b.token_to_req.dtype == torch.int32
    assert b.query_start_loc.tolist() == [sum(ql[:i]) for i in range(len(ql) + 1)]
    assert b.num_tokens == sum(ql) and b.num_reqs == len(ql)
    assert b.max_query_len == max(ql, default=0) and b.max_seq_len == max(sl, default=0)
    # default slot mapping: the token's own position through the SWA table (64 per block)
    assert b.slot_mapping.tolist() == [t2r[i] * 64 * 64 + p for i, p in enumerate(pos)]
    nd = 0
    while nd < len(ql) and ql[nd] <= thr and (not uniform or ql[nd] == ql[0]):
        nd += 1
    assert (b.num_decodes, b.num_prefills) == (nd, len(ql) - nd)
    assert (b.num_decode_tokens, b.num_prefill_tokens) == (sum(ql[:nd]), sum(ql[nd:]))


def test_split_speculative_tokens_are_decodes():
    assert split_decodes_and_prefills([1, 1, 5], 1) == (2, 1, 2, 5)
    assert split_decodes_and_prefills([3, 3, 2, 5], 3) == (3, 1, 8, 5)
    assert split_decodes_and_prefills([3, 3, 2, 5], 3, require_uniform=True) == (2, 2, 6, 7)
    assert split_decodes_and_prefills([], 1) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="decodes-first"):
        split_decodes_and_prefills([1, 5, 1], 1)


def test_from_tensors_and_positions(device):
    bt = tables(2, device=device)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    sl = torch.tensor([10, 3], dtype=torch.int32, device=device)
    pos = torch.tensor([9, 0, 1, 2], dtype=torch.int64, device=device)
    b = BatchMetadata.from_tensors(qsl, sl, bt, positions=pos)
    assert b.device.type == torch.device(device).type
    assert b.positions.tolist() == [9, 0, 1, 2]
    with pytest.raises(ValueError, match=r"positions\[2\]"):
        BatchMetadata.from_tensors(qsl, sl, bt, positions=torch.tensor([9, 0, 2, 2], device=device))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(query_lens=[1, -1], seq_lens=[3, 3]), ValueError, "query_lens"),
        (dict(query_lens=[4], seq_lens=[3]), ValueError, "smaller than its query_len"),
        (dict(query_lens=[1, 1], seq_lens=[3]), ValueError, "num_reqs"),
        (dict(query_lens=[1.5], seq_lens=[3]), TypeError, "query_lens"),
        (dict(query_lens=torch.tensor([1]), seq_lens=[3]), TypeError, "query_lens"),  # int64 tensor
        (dict(query_lens=[2, 1], seq_lens=[5, 5]), ValueError, "decodes-first"),
        (dict(query_lens=[1], seq_lens=[3], num_speculative_tokens=-1), ValueError, "num_speculative_tokens"),
        (dict(query_lens=[1], seq_lens=[3], block_tables={"swa": torch.zeros(1, 4)}), TypeError, "block_tables"),
        (dict(query_lens=[1], seq_lens=[3], block_tables={"swa": torch.zeros(0, 4, dtype=torch.int32)}),
         ValueError, "rows"),
        (dict(query_lens=[1], seq_lens=[3], block_tables={"full_mla": torch.zeros(1, 4, dtype=torch.int32)}),
         ValueError, "swa"),
        (dict(query_lens=[1], seq_lens=[3], block_tables={"swa": torch.zeros(1, 4, dtype=torch.int32),
                                                          "xx": torch.zeros(1, 4, dtype=torch.int32)}),
         ValueError, "unknown"),
        (dict(query_lens=[1], seq_lens=[3], slot_mapping=torch.zeros(1, dtype=torch.int32)), TypeError, "slot_mapping"),
        (dict(query_lens=[1], seq_lens=[3], slot_mapping=torch.zeros(2, dtype=torch.int64)), ValueError, "slot_mapping"),
        (dict(query_lens=[1], seq_lens=[3], positions=torch.zeros(1, dtype=torch.int32)), TypeError, "positions"),
        (dict(query_lens=[1], seq_lens=[300], block_tables={"swa": torch.zeros(1, 4, dtype=torch.int32)}),
         ValueError, "columns"),
    ],
)
def test_from_requests_rejects(kwargs, exc, match):
    kwargs.setdefault("block_tables", tables(max(1, len(kwargs["seq_lens"]))))
    with pytest.raises(exc, match=match):
        BatchMetadata.from_requests(**kwargs)


@pytest.mark.parametrize(
    "qsl,match",
    [([0, 3, 2], "non-decreasing"), ([1, 2, 3], r"query_start_loc\[0\]"), ([0, 1], "num_reqs")],
)
def test_from_tensors_rejects_bad_query_start_loc(qsl, match):
    with pytest.raises(ValueError, match=match):
        BatchMetadata.from_tensors(torch.tensor(qsl, dtype=torch.int32), torch.tensor([5, 5], dtype=torch.int32),
                                   tables(2))
    with pytest.raises(TypeError, match="query_start_loc"):
        BatchMetadata.from_tensors(torch.tensor([0, 1, 2]), torch.tensor([5, 5], dtype=torch.int32), tables(2))


def test_batch_is_frozen():
    b = BatchMetadata.from_requests([1], [3], tables(1))
    with pytest.raises(Exception):
        b.num_decodes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        b.block_tables["swa"] = None  # type: ignore[index]
