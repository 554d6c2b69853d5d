"""StepMetadataBuilder: every form against a naive per-token oracle, forms describe identical
candidate sets, byte accounting checked element by element on poisoned buffers, buffer
addresses stable across builds, and the validation errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4attn.metadata import FORMS, BatchMetadata, MetadataConfig, StepMetadataBuilder

MAX_MODEL_LEN = 20_000  # C128A row width round_up(157, 128) = 256: real form visibly narrower
MAX_T, MAX_R = 96, 8
SWA_COLS, MLA_COLS = -(-MAX_MODEL_LEN // 64), -(-MAX_MODEL_LEN // 256)
POISON = -7
HC = [HealthCheck.too_slow, HealthCheck.data_too_large]


def make_config(form: str, **kw) -> MetadataConfig:
    nb = {"swa": MAX_R * SWA_COLS + 3, "full_mla": MAX_R * MLA_COLS + 3}
    return MetadataConfig(max_num_batched_tokens=MAX_T, max_num_reqs=MAX_R, max_model_len=MAX_MODEL_LEN,
                          num_blocks=kw.pop("num_blocks", nb), form=form, **kw)


def make_batch(ql, sl, pad, seed, device, spec=0):
    g = torch.Generator().manual_seed(seed)
    r = len(ql)
    swa = torch.randperm(MAX_R * SWA_COLS, generator=g)[: r * SWA_COLS].to(torch.int32).view(r, SWA_COLS)
    mla = torch.randperm(MAX_R * MLA_COLS, generator=g)[: r * MLA_COLS].to(torch.int32).view(r, MLA_COLS)
    tabs = {"swa": swa.to(device), "full_mla": mla.to(device)}
    sm = torch.arange(sum(ql), dtype=torch.int64) * 5
    sm[torch.tensor(pad, dtype=torch.bool)] = -1
    return BatchMetadata.from_requests(ql, sl, tabs, sm.to(device), num_speculative_tokens=spec)


@st.composite
def steps(draw):
    spec = draw(st.integers(0, 2))
    nd = draw(st.integers(0, 5))
    npf = draw(st.integers(0, 3))
    ql = [draw(st.integers(1, 1 + spec)) for _ in range(nd)]
    ql += [draw(st.integers(2 + spec, 24)) for _ in range(npf)]
    sl = []
    for q in ql:
        near = draw(st.integers(0, 120)) * 128 + draw(st.integers(-3, 3))  # around C128A boundaries
        sl.append(min(MAX_MODEL_LEN, q + max(0, draw(st.one_of(st.integers(0, 17_000), st.just(near))))))
    pad = draw(st.lists(st.booleans(), min_size=sum(ql), max_size=sum(ql)))
    return ql, sl, pad, spec, draw(st.integers(0, 999))


def slot(bt, req, e, bs):
    return bt[req][e // bs] * bs + e % bs


def check_against_oracle(step, cfg):
    """Every candidate set of every token, by loops over tokens."""
    b = step.batch
    swa, mla = b.block_tables["swa"].tolist(), b.block_tables["full_mla"].tolist()
    sm = b.slot_mapping.tolist()
    toks = [(q, s - ql + i) for q, (ql, s) in enumerate(zip(b.query_lens_cpu, b.seq_lens_cpu)) for i in range(ql)]
    assert step.token_to_req.tolist() == [q for q, _ in toks]
    assert step.is_valid_token.tolist() == [x >= 0 for x in sm]
    c128 = step.compressed[128]
    for r in (4, 128):
        bs = 256 // r
        want = [slot(mla, q, (p + 1) // r - 1, bs) if (p + 1) % r == 0 else -1 for q, p in toks]
        assert step.compressed[r].slot_mapping.tolist() == want
    for t, (q, p) in enumerate(toks):
        ok = sm[t] >= 0
        start = max(0, p - cfg.window_size + 1)
        swa_set = {slot(swa, q, e, 64) for e in range(start, p + 1)} if ok else set()
        n = (p + 1) // 128
        c_set = {slot(mla, q, e, 2) for e in range(n)} if ok else set()
        if step.form == "range":
            s, ln = int(step.swa.starts[t]), int(step.swa.lengths[t])
            assert {slot(swa, q, e, 64) for e in range(s, s + ln)} == swa_set and ln == len(swa_set)
            s, ln = int(c128.starts[t]), int(c128.lengths[t])
            assert {slot(mla, q, e, 2) for e in range(s, s + ln)} == c_set and ln == len(c_set)
            continue
        if t < b.num_decode_tokens:
            ln = int(step.swa.decode_lens[t])
            row = step.swa.decode_indices[t, :ln].tolist()
            assert set(row) == swa_set and len(row) == len(swa_set)
            ln = int(c128.decode_lens[t])
            row = c128.global_decode[t, :ln].tolist()
            assert set(row) == c_set and len(row) == len(c_set)
            assert all(x == -1 for x in c128.global_decode[t, n : -(-n // 128) * 128].tolist())
        else:
            row = c128.prefill_local[t - b.num_decode_tokens].tolist()
            assert row[:n] == list(range(n)) and all(x == -1 for x in row[n : -(-n // 128) * 128])


@pytest.mark.parametrize("impl,examples", [("reference", 100), ("triton", 20)])
@pytest.mark.parametrize("form", FORMS)
def test_step_matches_oracle(form, impl, examples, device):
    builder = StepMetadataBuilder(make_config(form), device)

    @settings(max_examples=examples, deadline=None, suppress_health_check=HC)
    @given(case=steps())
    def run(case):
        ql, sl, pad, spec, seed = case
        step = builder.build(make_batch(ql, sl, pad, seed, device, spec), impl=impl)
        check_against_oracle(step, builder.config)

    run()


def _poison(builder):
    for buf in builder.buffers().values():
        (buf.view(torch.uint8).fill_(7) if buf.dtype == torch.bool else buf.fill_(POISON))


def _written_bytes(builder):
    total = 0
    for buf in builder.buffers().values():
        changed = buf.view(torch.uint8) != 7 if buf.dtype == torch.bool else buf != POISON
        total += int(changed.sum()) * buf.element_size()
    return total


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("form", FORMS)
def test_bytes_written_exact(form, impl, device):
    """bytes_written equals the count of elements that changed in poisoned buffers (so nothing
    outside the reported rows/slices is touched)."""
    builder = StepMetadataBuilder(make_config(form), device)
    for ql, sl in [([1, 1, 1, 30], [5, 9000, 17_000, 300]), ([2, 2, 17], [128, 256, 16_384]), ([], [])]:
        _poison(builder)
        step = builder.build(make_batch(ql, sl, [False] * sum(ql), 3, device, spec=1), impl=impl)
        assert _written_bytes(builder) == step.total_bytes_written


def test_forms_give_identical_candidate_sets(device):
    """Full (engine), real-context and range forms: same slots per token; fewer bytes."""
    ql, sl = [1, 1, 1, 1, 40], [1, 129, 5000, 19_999, 12_345]
    pad = [False, False, True, False] + [False] * 39 + [True]
    sets = {}
    for form in FORMS:
        builder = StepMetadataBuilder(make_config(form), device)
        step = builder.build(make_batch(ql, sl, pad, 7, device))
        check_against_oracle(step, builder.config)
        sets[form] = step.total_bytes_written
    assert sets["range"] < sets["real"] < sets["full"]


def test_buffer_addresses_stable_across_builds(device):
    builder = StepMetadataBuilder(make_config("real"), device)
    ptrs = {k: v.data_ptr() for k, v in builder.buffers().items()}
    for ql, sl in [([1, 1], [3, 700]), ([1, 20], [9000, 40]), ([30], [30])]:
        step = builder.build(make_batch(ql, sl, [False] * sum(ql), 1, device))
        assert {k: v.data_ptr() for k, v in builder.buffers().items()} == ptrs
        assert step.token_to_req.data_ptr() == ptrs["token_to_req"]
        assert step.compressed[4].slot_mapping.data_ptr() == ptrs["c4_slot_mapping"]
        if step.batch.num_decode_tokens:
            assert step.compressed[128].global_decode.data_ptr() == ptrs["c128_global_decode"]
            assert step.swa.decode_indices.data_ptr() == ptrs["swa_decode_indices"]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_global_topk_through_builder(impl, device):
    builder = StepMetadataBuilder(make_config("range", index_topk=16), device)
    step = builder.build(make_batch([1, 1, 3], [100, 2000, 900], [False, True, False, False, False], 2, device))
    # Entry 25 of token 0 (position 99 sees entries 0..24) and every entry of the padded token 1
    # are past the token's own context: holes, never another request's blocks.
    loc = torch.tensor([[0, 5, 25], [1, 2, 3], [-1, -1, -1], [63, 64, 200], [7, -1, 9]], dtype=torch.int32)
    g, lens = builder.global_topk(step, loc.to(device), impl=impl)
    mla = step.batch.block_tables["full_mla"].tolist()
    reqs, limit = [0, 1, 2, 2, 2], [25, 0, 224, 224, 225]
    want = [[slot(mla, reqs[t], i, 64) if 0 <= i < limit[t] else -1 for i in row] for t, row in enumerate(loc.tolist())]
    assert g.tolist() == want and lens.tolist() == [2, 0, 0, 3, 2]
    with pytest.raises(ValueError, match="topk_local"):
        builder.global_topk(step, torch.zeros(5, 17, dtype=torch.int32, device=device))


def test_builder_rejects(device):
    builder = StepMetadataBuilder(make_config("full"), device)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        builder.build(make_batch([MAX_T + 1], [MAX_T + 1], [False] * (MAX_T + 1), 0, device))
    with pytest.raises(ValueError, match="max_num_reqs"):
        small = StepMetadataBuilder(MetadataConfig(max_num_batched_tokens=8, max_num_reqs=2, max_model_len=MAX_MODEL_LEN,
                                                   num_blocks=10**6), device)
        small.build(make_batch([1, 1, 1], [4, 4, 4], [False] * 3, 0, device))
    with pytest.raises(ValueError, match="max_model_len"):
        StepMetadataBuilder(MetadataConfig(max_num_batched_tokens=8, max_num_reqs=2, max_model_len=100,
                                           num_blocks=10**6), device).build(make_batch([1], [101], [False], 0, device))
    # block id beyond num_blocks in a used column of each group
    for group, nb in [("swa", {"swa": 5, "full_mla": 10**6}), ("full_mla", {"swa": 10**6, "full_mla": 3})]:
        b = make_batch([1, 1], [3000, 700], [False, False], 0, device)
        with pytest.raises(ValueError, match=f"block_tables\\['{group}'\\]"):
            StepMetadataBuilder(make_config("full", num_blocks=nb), device).build(b)
    # a -1 (unallocated) block inside the used range
    b = make_batch([1], [3000], [False], 0, device)
    b.block_tables["full_mla"][0, 2] = -1
    with pytest.raises(ValueError, match="not a block id"):
        builder.build(b)
    # table too narrow for the context
    tabs = {g: torch.zeros(1, 2, dtype=torch.int32, device=device) for g in ("swa", "full_mla")}
    with pytest.raises(ValueError, match="columns"):
        builder.build(BatchMetadata.from_requests([1], [1000], tabs, torch.zeros(1, dtype=torch.int64, device=device)))
    # missing group
    tabs = {"swa": torch.zeros(1, 40, dtype=torch.int32, device=device)}
    with pytest.raises(ValueError, match="lacks group"):
        builder.build(BatchMetadata.from_requests([1], [100], tabs))
    with pytest.raises(TypeError, match="BatchMetadata"):
        builder.build("batch")


@pytest.mark.parametrize(
    "kw,match",
    [(dict(form="wide"), "form"), (dict(compress_ratios=(4, 64)), "compress_ratios"),
     (dict(max_num_reqs=0), "max_num_reqs"), (dict(num_blocks={"swa": 0}), "num_blocks"),
     (dict(mla_block_size=100), "mla_block_size")],
)
def test_config_rejects(kw, match):
    base = dict(max_num_batched_tokens=8, max_num_reqs=2, max_model_len=1024, num_blocks=10)
    with pytest.raises(ValueError, match=match):
        MetadataConfig(**(base | kw))


def test_bytes_follow_real_context_not_max_model_len():
    """max_model_len 1M: the engine form writes 8192 int32 per C128A row whatever the context;
    the real-context form writes round_up(n, 128) and the range form one length per token."""
    from dsv4attn.metadata import metadata_bytes_written

    cfg = MetadataConfig(max_num_batched_tokens=8192, max_num_reqs=64, max_model_len=1 << 20, num_blocks=1 << 20)
    tabs = {g: torch.zeros(64, 1, dtype=torch.int32) for g in ("swa", "full_mla")}
    batch = BatchMetadata.from_requests([1] * 64, [8192] * 64, tabs, torch.zeros(64, dtype=torch.int64))
    full = metadata_bytes_written(batch, cfg, "full")
    real = metadata_bytes_written(batch, cfg, "real")
    rng = metadata_bytes_written(batch, cfg, "range")
    assert full["c128.topk_rows"] == 64 * 8192 * 4
    assert real["c128.topk_rows"] == 64 * 128 * 4  # n = 64 entries -> one 128-wide aligned chunk
    assert rng["c128.lengths"] == 64 * 4 and "c128.topk_rows" not in rng
    assert sum(full.values()) > 20 * sum(real.values()) > 20 * sum(rng.values())
