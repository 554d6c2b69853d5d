"""Call plans (:mod:`dsv4attn.ops.call_plan`): a call served by a plan launches exactly what the
checked path launches for the same inputs, and bad input is still refused after a plan exists.

On CPU the kernels are stand-ins that log each launch (every argument, in Triton's launcher
order) and the launch cache serves CPU tensors (``launches_through_cache``). A launch is
compared in canonical form: each tensor argument (a tensor on the checked path, an address on a
planned one) named by the call's tensor at that address (``q``, ``s0.cache``, ...) or, for
memory the call allocated, by the order it first appears in; every other argument as is. The GPU tests at the
end compare a planned call's outputs with the checked path's, bit for bit, on the real kernels.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import dsv4attn
from dsv4attn.ops import call_plan, launch_cache
from dsv4attn.ops import sparse_attn as sa
from dsv4attn.ops import sparse_attn_launch as sl
from dsv4attn.ops.candidate_set import CandidateSet
from dsv4attn.testing.attention_oracle import PROD_LAYOUT, SetSpec, build_set
from dsv4attn.testing.stand_ins import replace_attention_kernels

pytestmark = pytest.mark.usefixtures("launches_through_cache")
HAS_CUDA = torch.cuda.is_available()


#: The stream a direct stand-in launch must get (``sm90+direct``: what the plans' stream lookup returns).
_STREAM = 0x5EED


class _Compiled:
    """A compiled kernel: ``[grid]`` gives a runner that logs its arguments. With ``direct``
    it also has the parts a plan launches without the runner (``run``, Triton's launcher, with
    the stream, ``function`` and ``packed_metadata`` first): those launches log the same way
    and are counted in ``direct_launches``."""

    def __init__(self, log: list, direct: bool = False, direct_launches: list | None = None) -> None:
        self.log, self.direct_launches = log, direct_launches
        if direct:
            self.function, self.packed_metadata = object(), object()
            self.run = self._run

    def __getitem__(self, grid):
        def run(*args):
            self.log.append((tuple(grid), args))
        return run

    def _run(self, gx, gy, gz, stream, function, meta, launch_metadata, enter_hook, exit_hook, *args):
        assert (stream, function, meta) == (_STREAM, self.function, self.packed_metadata)
        assert launch_metadata is None and enter_hook is None and exit_hook is None
        self.direct_launches.append(1)
        self.log.append(((gx, gy, gz), args))


class _StandIn:
    """Stands in for a ``@triton.jit`` kernel (the real one's parameters): a bound launch logs
    what Triton's launcher would get and returns a :class:`_Compiled`."""

    def __init__(self, real, log: list, direct: bool = False, direct_launches: list | None = None) -> None:
        self.fn, self.log = real.fn, log
        self.direct, self.direct_launches = direct, direct_launches

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            tail = launch_cache.bound_tail(self, len(args), kwargs)
            self.log.append(((tuple(grid) + (1, 1))[:3], (*args, *tail)))
            return _Compiled(self.log, self.direct, self.direct_launches)
        return run


class _Log(list):
    """The launch log; ``direct``: one entry per launch a plan made without Triton's runner;
    ``is_direct``: whether the stand-ins allow such launches."""

    direct: list
    is_direct: bool


@pytest.fixture(params=["portable", "sm90", "sm90+direct"])
def stand_ins(request, monkeypatch):
    """Stand-ins for every attention kernel; ``sm90``: dispatch takes the Gluon kernels (as on
    Hopper), whose stand-ins carry their real parameter lists; ``+direct``: their compiled
    kernels have the parts of Triton's (launcher, function, metadata), so plans launch them
    without the runner, on the stream that :func:`call_plan._stream_source` finds."""
    log = _Log()
    direct = request.param.endswith("+direct")
    log.direct, log.is_direct = [], direct
    if direct:
        monkeypatch.setattr(call_plan, "_stream_source", lambda: ((lambda device: _STREAM + device), 0))
        monkeypatch.setattr(call_plan, "DIRECT", True)
    replace_attention_kernels(lambda real: _StandIn(real, log, direct, log.direct),
                              sm90=request.param.startswith("sm90"), set_attr=monkeypatch.setattr,
                              compiled=lambda: _Compiled(log, direct, log.direct))
    yield log
    sl._cached_config.cache_clear()


def _canonical(log: list, positions: list, named: dict, outputs) -> tuple:
    """The logged launches with the arguments at tensor ``positions`` named (see the module
    docstring), and the outputs' names. ``named``: the call's own tensors by name."""
    by_ptr = {t.data_ptr(): n for n, t in named.items() if isinstance(t, torch.Tensor) and t.numel()}
    fresh: dict[int, str] = {}

    def name(a) -> str:
        ptr = a if isinstance(a, int) else a.data_ptr()
        return by_ptr[ptr] if ptr in by_ptr else fresh.setdefault(ptr, f"new{len(fresh)}")

    launches = tuple((grid, tuple(name(a) if i in pos else a for i, a in enumerate(args)))
                     for (grid, args), pos in zip(log, positions))
    return launches, tuple(None if t is None else name(t) for t in outputs)


def _planned_equals_checked(make, run, log: list, counter: list) -> None:
    """Calls 1-2 make the plan (a signature is recorded at its second call); calls 3-4 (fresh
    inputs of the same signature) run it, with no check, and each launches what the checked path
    launches on the same inputs (plans cleared, so the call is checked again, then planned
    again)."""
    run(make())
    run(make())
    assert counter[0] > 0
    for _ in range(2):
        inputs = make()
        log.clear()
        counter[0] = 0
        direct_before = len(log.direct)
        res = run(inputs)
        assert counter[0] == 0, "a planned call ran the checks"
        planned_log = list(log)
        # With launchers to call directly, every planned launch is one (else none is).
        assert len(log.direct) - direct_before == (len(planned_log) if log.is_direct else 0)
        call_plan.clear()
        log.clear()
        res2 = run(inputs)
        assert counter[0] > 0
        positions = [{i for i, a in enumerate(args) if isinstance(a, torch.Tensor)} for _, args in log]
        assert all(positions)
        assert _canonical(planned_log, positions, inputs, res) == _canonical(log, positions, inputs, res2)
        run(inputs)  # the second call since the clear: planned again


def _count_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that counts its calls; returns the 1-element count."""
    count = [0]
    real = getattr(module, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return count


@pytest.fixture
def counter(monkeypatch):
    """Counts the checked path's set checks (none on a planned call)."""
    return _count_calls(monkeypatch, sa, "check_candidate_set")


OP_CASES = ["two-fp8-sets", "h128-split", "range+idx-bf16-out", "prefill-shared", "deterministic"]


def _op_case(case: str, device):
    """(make, run) of one ``sparse_mla_attention`` case: ``make()`` gives fresh inputs (copies
    at new addresses, one signature), ``run(inputs)`` calls the op and returns its outputs."""
    gen = torch.Generator().manual_seed(len(case))
    heads = {"prefill-shared": 16, "h128-split": 128}.get(case, 64)
    specs = {
        "two-fp8-sets": [SetSpec("indices", True, 64, 200), SetSpec("indices", True, 64, 64)],
        "h128-split": [SetSpec("indices", True, 64, 300)],
        "range+idx-bf16-out": [SetSpec("range", False, 16, 120), SetSpec("indices", False, 32, 50)],
        "prefill-shared": [SetSpec("range", True, 16, 90), SetSpec("indices", True, 16, 40)],
        "deterministic": [SetSpec("indices", True, 64, 130)],
    }[case]
    tokens = 5
    sets = [build_set(s, tokens, [t * 2 // tokens for t in range(tokens)], PROD_LAYOUT, gen, device).cset
            for s in specs]
    q_dtype = torch.float32 if case == "range+idx-bf16-out" else torch.bfloat16
    q = torch.randn(tokens, heads, PROD_LAYOUT.head_dim, generator=gen).to(q_dtype).to(device)
    sink = torch.randn(heads, generator=gen).to(device)
    kw = dict(num_splits=3 if case == "h128-split" else None, prefill=case == "prefill-shared",
              deterministic=case == "deterministic", impl="triton")

    def make() -> dict:
        inputs = {"q": q.clone(), "sink": sink.clone(),
                  "out": torch.empty_like(q) if case == "range+idx-bf16-out" else None}
        for i, s in enumerate(sets):
            for f in dataclasses.fields(s):
                v = getattr(s, f.name)
                inputs[f"s{i}.{f.name}"] = v.clone() if isinstance(v, torch.Tensor) else v
        return inputs

    def run(x: dict):
        ss = [CandidateSet(**{f.name: x[f"s{i}.{f.name}"] for f in dataclasses.fields(CandidateSet)})
              for i in range(len(sets))]
        return dsv4attn.sparse_mla_attention(x["q"], ss, 0.05, x["sink"], x["out"], **kw)

    return make, run


@pytest.mark.parametrize("case", OP_CASES)
def test_planned_op_launches_what_the_checked_path_launches(case, stand_ins, counter, device):
    make, run = _op_case(case, device)
    _planned_equals_checked(make, run, stand_ins, counter)


def test_cluster_launches_are_kept_and_planned(stand_ins, counter, monkeypatch, request, device):
    """h128 on fp8 pages with ``sm90_cluster``: the first launch of a specialisation builds the
    two-CTA cluster kernel (``_cluster_kernel``, stood in for here) and launches it on (tokens,
    splits) clusters; every later call, planned or not, relaunches the kept kernel on the same
    grid, and a planned call launches what the checked path launches."""
    if request.node.callspec.params["stand_ins"] == "portable":
        pytest.skip("the cluster is an sm90 kernel")
    pick = sl.kernel_config
    monkeypatch.setattr(sl, "kernel_config", lambda *a, **k: dataclasses.replace(pick(*a, **k), sm90_cluster=True))
    sl._cached_config.cache_clear()
    builds: list = []

    def build(kernel, warps, grid, args, consts):
        builds.append((grid, consts["DUAL"]))
        return _Compiled(stand_ins, stand_ins.is_direct, stand_ins.direct)

    monkeypatch.setattr(sl, "_cluster_kernel", build)
    make, run = _op_case("h128-split", device)
    _planned_equals_checked(make, run, stand_ins, counter)
    assert not sl._cluster_failures
    assert builds == [((5, 3), True)]  # one specialisation, built once, two producers (the default)
    attention = [grid for grid, args in stand_ins if len(args) > 40]  # not the combine kernel
    assert attention and all(grid == (5, 3, 1) for grid in attention)


FLASHMLA_CASES = ["kvcache-two-caches", "kvcache-mtp-lengths", "kvcache-fp8-dtype-out", "kvcache-head-dim-v",
                  "sparse-fwd", "sparse-fwd-dv-out"]


def _flashmla_case(case: str, device):
    """(make, run, wrapper planned) of one FlashMLA-compatible case (see :func:`_op_case`).
    ``kvcache-mtp-lengths`` (s_q 2): the op gets the per-request lengths repeated per token, a
    new tensor each call, which the planned call makes too. ``sparse-fwd-dv-out`` (an out of 448
    dims, which the result is copied into) keeps no plan of its own: its op call is planned."""
    gen = torch.Generator().manual_seed(len(case) + 7)
    s_q = 2 if case == "kvcache-mtp-lengths" else 1
    batch, heads = 3, 64
    tokens = batch * s_q
    a = build_set(SetSpec("indices", True, 64, 150), tokens, [0] * tokens, PROD_LAYOUT, gen, device).cset
    b = build_set(SetSpec("indices", True, 16, 40), tokens, [0] * tokens, PROD_LAYOUT, gen, device).cset
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).to(device)
    sink = torch.randn(heads, generator=gen).to(device)
    lens = torch.tensor([150, 7, 0][:batch], dtype=torch.int32, device=device)
    kv = torch.randn(300, 1, 512, generator=gen).to(torch.bfloat16).to(device)
    flat_idx = torch.randint(-1, 320, (tokens, 1, 64), generator=gen, dtype=torch.int32).to(device)
    d_v = 448 if case in ("kvcache-head-dim-v", "sparse-fwd-dv-out") else 512
    meta = dsv4attn.get_mla_metadata()[0]  # one per shape, shared by the calls (as engines do)

    def make() -> dict:
        x = {"q": q.clone(), "sink": sink.clone(), "lens": lens.clone(), "a.cache": a.cache.clone(),
             "a.indices": a.indices.clone(), "b.cache": b.cache.clone(), "b.indices": b.indices.clone(),
             "kv": kv.clone(), "flat_idx": flat_idx.clone(), "out": None}
        if case == "kvcache-fp8-dtype-out":
            x["out"] = torch.empty(batch, s_q, heads, 512, dtype=torch.bfloat16, device=device)
        if case == "sparse-fwd-dv-out":
            x["out"] = torch.empty(tokens, heads, d_v, dtype=torch.bfloat16, device=device)
        return x

    def run(x: dict):
        if case.startswith("sparse-fwd"):
            res = dsv4attn.flash_mla_sparse_fwd(x["q"], x["kv"], x["flat_idx"], 0.07, d_v=d_v, attn_sink=x["sink"],
                                                out=x["out"], impl="triton")
            return res
        cache = x["a.cache"].unsqueeze(-2)
        if case == "kvcache-fp8-dtype-out":
            cache = cache.view(torch.float8_e4m3fn)
        two = case in ("kvcache-two-caches", "kvcache-mtp-lengths")
        return dsv4attn.flash_mla_with_kvcache(
            x["q"].view(batch, s_q, heads, 512), cache, None, None, d_v, meta, softmax_scale=0.07,
            is_fp8_kvcache=True, indices=x["a.indices"].view(batch, s_q, -1), attn_sink=x["sink"],
            extra_k_cache=x["b.cache"].unsqueeze(-2) if two else None,
            extra_indices_in_kvcache=x["b.indices"].view(batch, s_q, -1) if two else None,
            topk_length=x["lens"] if case != "kvcache-fp8-dtype-out" else None, out=x["out"], impl="triton")

    return make, run, case != "sparse-fwd-dv-out"


@pytest.fixture
def wrapper_counter(monkeypatch):
    """Counts the FlashMLA-compatible entry points' own tensor checks."""
    from dsv4attn import flashmla_compat

    return _count_calls(monkeypatch, flashmla_compat, "check_tensor")


@pytest.mark.parametrize("case", FLASHMLA_CASES)
def test_planned_flashmla_calls_launch_what_the_checked_path_launches(case, stand_ins, counter, wrapper_counter,
                                                                     device):
    make, run, wrapper_planned = _flashmla_case(case, device)
    _planned_equals_checked(make, run, stand_ins, counter)
    # The entry point's own checks are skipped too, unless it cannot keep a plan of its own.
    wrapper_counter[0] = 0
    out = run(make())
    assert (wrapper_counter[0] == 0) is wrapper_planned
    if case == "kvcache-fp8-dtype-out":
        assert out[0].shape == (3, 1, 64, 512)
    if case == "sparse-fwd-dv-out":
        assert out[0].shape == (3, 64, 448)


def test_planned_outputs_have_the_checked_shapes_and_views(stand_ins, device):
    """A planned call returns what the checked call returns: same shapes, strides, dtypes, and
    the caller's out itself where one was given."""
    for case in FLASHMLA_CASES:
        make, run, _ = _flashmla_case(case, device)
        call_plan.clear()
        x = make()
        checked = run(x)
        run(x)  # recorded
        planned = run(x)
        for c, p in zip(checked, planned):
            assert (c.shape, c.stride(), c.dtype) == (p.shape, p.stride(), p.dtype), case
        if x["out"] is not None:
            assert planned[0].data_ptr() == x["out"].data_ptr()
        if case.startswith("kvcache"):  # allocated in the returned shapes, no view per call, where they are dense
            (kept,) = [v for v in call_plan._plans.values() if isinstance(v, tuple)]
            assert kept[-1] is (case != "kvcache-head-dim-v"), case


# Each bad variant of a call whose good form has a plan: (what changes, the error).
BAD_OP_CALLS = [
    ("prefill=1", TypeError), ("deterministic=0", TypeError), ("softmax_scale=nan", TypeError),
    ("lengths int64", TypeError), ("q fp16", TypeError), ("cache 2 bytes in", ValueError),
    ("sets a duck", TypeError), ("sink shape", ValueError), ("out dtype", TypeError), ("num_splits=0", ValueError),
    ("impl=fast", ValueError), ("indices strided", ValueError), ("lengths on meta", ValueError),
    ("softmax_scale a list", TypeError),
]


@pytest.mark.parametrize("change,error", BAD_OP_CALLS, ids=[c for c, _ in BAD_OP_CALLS])
def test_bad_input_is_refused_after_a_plan_exists(change, error, stand_ins, device):
    """A plan serves only the signature that passed the checks: any other call takes the checked
    path, which refuses bad input as before (the same error as without a plan)."""
    gen = torch.Generator().manual_seed(5)
    s = build_set(SetSpec("indices", True, 64, 100), 4, [0] * 4, PROD_LAYOUT, gen, device).cset
    q = torch.randn(4, 64, 512, generator=gen).to(torch.bfloat16).to(device)
    sink = torch.zeros(64, device=device)
    good = dict(q=q, sets=[s], softmax_scale=0.1, attn_sink=sink, out=None, impl="triton", prefill=False,
                deterministic=False, num_splits=None)

    class Duck:  # a CandidateSet's fields, but no CandidateSet
        def __init__(self, s):
            self.__dict__.update({f.name: getattr(s, f.name) for f in dataclasses.fields(s)})

    wide = torch.full((4, 200), -1, dtype=torch.int32, device=device)
    wide[:, ::2] = s.indices
    shifted = torch.empty(s.cache.numel() + 2, dtype=torch.uint8, device=device)[2:].view(s.cache.shape)
    bad = dict(good)
    bad.update({
        "prefill=1": dict(prefill=1), "deterministic=0": dict(deterministic=0),
        "softmax_scale=nan": dict(softmax_scale=float("nan")),
        "lengths int64": dict(sets=[dataclasses.replace(s, lengths=s.lengths.long())]),
        "q fp16": dict(q=q.half()), "cache 2 bytes in": dict(sets=[dataclasses.replace(s, cache=shifted)]),
        "sets a duck": dict(sets=[Duck(s)]), "sink shape": dict(attn_sink=sink[:32]),
        "out dtype": dict(out=torch.empty(4, 64, 512, device=device)), "num_splits=0": dict(num_splits=0),
        "impl=fast": dict(impl="fast"), "softmax_scale a list": dict(softmax_scale=[0.1]),  # an unhashable key
        "indices strided": dict(sets=[dataclasses.replace(s, indices=wide[:, ::2])]),
        "lengths on meta": dict(sets=[dataclasses.replace(s, lengths=s.lengths.to("meta"))]),
    }[change])
    call = lambda kw: sa.sparse_mla_forward(**kw)  # noqa: E731
    with pytest.raises(error) as without_plan:
        call(bad)
    call(good)
    call(good)  # recorded: a plan exists from here
    with pytest.raises(error) as with_plan:
        call(bad)
    assert str(with_plan.value) == str(without_plan.value)
    if change.startswith("softmax_scale"):
        assert "softmax_scale" in str(with_plan.value)


def test_metadata_bound_to_other_shapes_is_refused_by_a_planned_signature(stand_ins, device):
    """flash_mla_with_kvcache's metadata rule holds on a planned signature: an object first used
    with other shapes is refused, a fresh one is bound to the planned shapes."""
    make, run, _ = _flashmla_case("kvcache-two-caches", device)
    x = make()
    run(x)
    run(x)  # recorded: a plan exists from here
    a = x["a.cache"].unsqueeze(-2)
    other = dsv4attn.get_mla_metadata()[0]
    small = dict(is_fp8_kvcache=True, indices=x["a.indices"][:2].view(2, 1, -1), impl="triton")
    dsv4attn.flash_mla_with_kvcache(x["q"][:2].view(2, 1, 64, 512), a, None, None, 512, other, **small)
    planned_args = (x["q"].view(3, 1, 64, 512), a, None, None, 512)
    kw = dict(softmax_scale=0.07, is_fp8_kvcache=True, indices=x["a.indices"].view(3, 1, -1), attn_sink=x["sink"],
              extra_k_cache=x["b.cache"].unsqueeze(-2), extra_indices_in_kvcache=x["b.indices"].view(3, 1, -1),
              topk_length=x["lens"], impl="triton")
    with pytest.raises(ValueError, match="tile_scheduler_metadata was first used"):
        dsv4attn.flash_mla_with_kvcache(*planned_args, other, **kw)
    fresh = dsv4attn.get_mla_metadata()[0]
    dsv4attn.flash_mla_with_kvcache(*planned_args, fresh, **kw)
    assert fresh.have_initialized and fresh.config == (3, 1, 64, 64, 150, 16, 40)
    assert int(fresh.num_splits[0]) >= 1


def test_planned_launches_take_the_runner_while_a_launch_hook_is_set(stand_ins, monkeypatch, device):
    """A launch hook (a profiler's) gets Triton's launch metadata: while one is set, plans
    launch through the runner, which builds it; so they do with ``call_plan.DIRECT`` off. They
    launch the same arguments either way."""
    from triton import knobs

    make, run = _op_case("two-fp8-sets", device)
    x = make()
    stand_ins.clear()
    run(x)
    positions = [{i for i, a in enumerate(args) if isinstance(a, torch.Tensor)} for _, args in stand_ins]
    run(x)  # the plan

    def hook(metadata) -> None:
        pass

    seen = []
    for direct, hooked in ((True, False), (True, True), (False, False), (True, False)):
        monkeypatch.setattr(call_plan, "DIRECT", direct and stand_ins.is_direct)
        if hooked:
            knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert call_plan.hooks_idle() is not hooked
            stand_ins.clear()
            before = len(stand_ins.direct)
            res = run(x)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        direct_launches = len(stand_ins.direct) - before
        assert direct_launches == (len(stand_ins) if stand_ins.is_direct and direct and not hooked else 0)
        seen.append(_canonical(stand_ins, positions, x, res))
    assert all(s == seen[0] for s in seen)


def test_plans_follow_the_launch_cache(stand_ins, counter, device):
    """A signature is planned at its second call and replayed from its third; clearing the
    launch cache forgets the plans; with the cache off no plan is made or used."""
    make, run = _op_case("two-fp8-sets", device)
    for planned in (False, False, True):
        counter[0] = 0
        run(make())
        assert (counter[0] == 0) is planned
    launch_cache.clear()
    counter[0] = 0
    run(make())
    assert counter[0] > 0  # checked again
    launch_cache.ENABLED = False  # the fixture restores it
    for _ in range(3):
        counter[0] = 0
        run(make())
        assert counter[0] > 0


GPU_CASES = OP_CASES + FLASHMLA_CASES


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("direct", [False, True], ids=["runner", "direct"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_planned_call_equals_checked_call_bit_for_bit_on_the_gpu(case, direct, monkeypatch):
    """Real kernels: a planned call's outputs equal the checked path's on the same inputs, bit
    for bit (NaN-filled outputs beforehand, so every element is written by both); planned
    launches through Triton's runner and through its launcher directly (``call_plan.DIRECT``)."""
    monkeypatch.setattr(call_plan, "DIRECT", direct)
    device = torch.device("cuda")
    if case in OP_CASES:
        make, run = _op_case(case, device)
    else:
        make, run, _ = _flashmla_case(case, device)
    call_plan.clear()
    run(make())
    run(make())  # makes the plan
    x = make()
    if x["out"] is not None:
        x["out"].fill_(float("nan"))
    planned = [t.clone() for t in run(x) if t is not None]
    call_plan.clear()
    if x["out"] is not None:
        x["out"].fill_(float("nan"))
    checked = [t.clone() for t in run(x) if t is not None]
    assert len(planned) == len(checked)
    for p, c in zip(planned, checked):
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.bfloat16 else p.view(torch.int32),
                           c.view(torch.uint8) if c.dtype == torch.bfloat16 else c.view(torch.int32)), case


def test_one_tensor_in_two_roles_keeps_no_plan(stand_ins, device):
    """Recorded with one tensor as both sets' lengths, a launch argument cannot say which role it
    came from: no plan is kept, and a later call of that signature with two different tensors
    launches what the checked path launches (each set its own lengths)."""
    gen = torch.Generator().manual_seed(11)
    a = build_set(SetSpec("indices", True, 64, 100), 4, [0] * 4, PROD_LAYOUT, gen, device).cset
    b = build_set(SetSpec("indices", True, 64, 60), 4, [0] * 4, PROD_LAYOUT, gen, device).cset
    q = torch.randn(4, 64, 512, generator=gen).to(torch.bfloat16).to(device)
    shared = torch.tensor([100, 50, 7, 0], dtype=torch.int32, device=device)
    run = lambda la, lb: sa.sparse_mla_forward(  # noqa: E731
        q, [dataclasses.replace(a, lengths=la), dataclasses.replace(b, lengths=lb)], 0.1, impl="triton")
    run(shared, shared)
    run(shared, shared)  # recorded (a plan would be kept here)
    la, lb = shared.clone(), torch.tensor([60, 1, 2, 3], dtype=torch.int32, device=device)
    named = {"q": q, "a.cache": a.cache, "a.indices": a.indices, "b.cache": b.cache, "b.indices": b.indices,
             "la": la, "lb": lb}
    stand_ins.clear()
    res = run(la, lb)
    first = list(stand_ins)
    call_plan.clear()
    stand_ins.clear()
    res2 = run(la, lb)
    positions = [{i for i, x in enumerate(args) if isinstance(x, torch.Tensor)} for _, args in stand_ins]
    assert _canonical(first, positions, named, res) == _canonical(stand_ins, positions, named, res2)


@pytest.mark.parametrize("case", ["kvcache-mtp-lengths", "sparse-fwd"])
def test_bad_lengths_are_refused_after_a_flashmla_plan_exists(case, stand_ins, device):
    """A FlashMLA-compatible signature with a plan: lengths of another dtype or size take the
    checked path and are refused, naming the argument."""
    make, run, _ = _flashmla_case(case, device)
    x = make()
    run(x)
    run(x)  # recorded: a plan exists from here
    if case == "sparse-fwd":
        q, kv, idx = x["q"], x["kv"], x["flat_idx"]
        for bad in (torch.zeros(3, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int32, device=device)):
            with pytest.raises((TypeError, ValueError), match="topk_length"):
                dsv4attn.flash_mla_sparse_fwd(q, kv, idx, 0.07, attn_sink=x["sink"], topk_length=bad, impl="triton")
        return
    for bad in (x["lens"].long(), x["lens"][:2]):
        with pytest.raises((TypeError, ValueError), match="topk_length"):
            dsv4attn.flash_mla_with_kvcache(
                x["q"].view(3, 2, 64, 512), x["a.cache"].unsqueeze(-2), None, None, 512, dsv4attn.get_mla_metadata()[0],
                softmax_scale=0.07, is_fp8_kvcache=True, indices=x["a.indices"].view(3, 2, -1), attn_sink=x["sink"],
                extra_k_cache=x["b.cache"].unsqueeze(-2), extra_indices_in_kvcache=x["b.indices"].view(3, 2, -1),
                topk_length=bad, impl="triton")


def test_a_tail_of_an_allocation_is_launched_at_its_offset(device):
    """:func:`call_plan.tail` (the split-KV partials share one allocation): a planned call
    passes the tail as its allocation's address plus the recorded byte offset; a plan that
    would return a tail is not made."""
    log: list = []
    compiled = _Compiled(log)
    q = torch.zeros(4, device=device)
    with call_plan.recording([q]) as rec:
        buf = call_plan.empty((10,), torch.float32, device)
        part = call_plan.tail(buf, 6)
        assert part.data_ptr() == buf.data_ptr() + 24 and part.numel() == 4
        call_plan.note_launch(compiled, (2,), [q, part, buf, 7])
        plan = call_plan.finish(rec, ("tail",), [buf], device)
    assert plan is not None
    x = torch.zeros(4, device=device)
    (out,) = plan.run([x])
    ((grid, args),) = log
    assert grid == (2, 1, 1) and args == (x.data_ptr(), out.data_ptr() + 24, out.data_ptr(), 7)
    assert out.shape == (10,) and out.dtype == torch.float32
    with call_plan.recording([q]) as rec:
        buf = call_plan.empty((10,), torch.float32, device)
        part = call_plan.tail(buf, 6)
        call_plan.note_launch(compiled, (2,), [q, part, buf])
        assert call_plan.finish(rec, ("tail returned",), [part], device) is None


def test_a_shaped_plan_allocates_outputs_in_their_final_views(device):
    """:meth:`CallPlan.shaped`: an allocated output whose final view covers the allocation
    exactly (a transpose) is allocated with that view's shape and strides and launched at its
    address; a role output is returned as the caller's tensor. A final that is a slice, a
    broadcast, another tensor's view, or a role output in another shape keeps no shaped plan."""
    log: list = []
    compiled = _Compiled(log)
    q, o = torch.zeros(4, device=device), torch.zeros(2, 3, device=device)
    with call_plan.recording([q, o]) as rec:
        buf = call_plan.empty((4, 6), torch.float32, device)
        call_plan.note_launch(compiled, (1,), [q, buf, o])
        plan = call_plan.finish(rec, ("shaped",), [buf, o], device)
    assert plan is not None
    shaped = plan.shaped([buf, o], [buf.t(), o], [q, o])
    assert shaped is not None
    x, y = torch.zeros(4, device=device), torch.zeros(2, 3, device=device)
    t, r = shaped.run([x, y])
    assert (t.shape, t.stride(), t.dtype) == ((6, 4), (1, 6), torch.float32) and r is y
    assert log[-1] == ((1, 1, 1), (x.data_ptr(), t.data_ptr(), y.data_ptr()))
    (u, _) = plan.run([x, y])  # the plan itself is unchanged
    assert (u.shape, u.stride()) == ((4, 6), (6, 1))
    for finals in ([buf[:, :3], o], [buf.view(-1)[:1].expand(24), o], [torch.zeros(6, 4, device=device), o],
                   [buf.t(), o.view(-1)], [buf.t(), None]):
        assert plan.shaped([buf, o], finals, [q, o]) is None


def test_an_unhashable_signature_is_never_planned():
    """A key holding an unhashable argument (e.g. a bad layout object the checks will name):
    nothing is found, seen or kept under it, and no TypeError escapes before the checks."""
    key = ("entry", ([1, 2],))
    call_plan.clear()
    assert call_plan.get(key) is None
    assert call_plan.seen_before(key) is False
    assert call_plan.seen_before(key) is False  # still not seen: it cannot be remembered
    call_plan.keep(key, "plan")
    assert call_plan.get(key) is None
    assert call_plan.get(("entry", (1, 2))) is None


@pytest.mark.parametrize("value,direct", [(None, True), ("1", True), ("0", False)])
def test_the_environment_switches_direct_launches(value, direct):
    """Planned kernels launch directly (``call_plan.DIRECT``) unless ``DSV4ATTN_DIRECT_LAUNCH=0``
    turns it off for a process (a GPU call can then time or test the runner path)."""
    env = {k: v for k, v in os.environ.items() if k != "DSV4ATTN_DIRECT_LAUNCH"}
    if value is not None:
        env["DSV4ATTN_DIRECT_LAUNCH"] = value
    res = subprocess.run([sys.executable, "-c", "from dsv4attn.ops import call_plan; print(call_plan.DIRECT)"],
                         env=env, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == str(direct)


@pytest.mark.parametrize("change,name", [("out shape", "out"), ("out dtype", "out"), ("head_dim_v", "head_dim_v"),
                                         ("q dtype", "q"), ("extra_k_cache alone", "extra_k_cache")])
def test_bad_input_is_refused_after_a_shaped_flashmla_plan_exists(change, name, stand_ins, device):
    """A ``flash_mla_with_kvcache`` signature whose plan allocates out and lse in their returned
    shapes: a bad variant of the call takes the checked path and is refused naming the argument,
    launches nothing and leaves the caches as they were; the shaped plan still serves the good call."""
    make, run, _ = _flashmla_case("kvcache-two-caches", device)
    x = make()
    run(x)
    good = run(x)  # recorded: a shaped plan exists from here
    assert [v for v in call_plan._plans.values() if isinstance(v, tuple)][0][-1] is True
    caches = (x["a.cache"].clone(), x["b.cache"].clone())
    q4, meta = x["q"].view(3, 1, 64, 512), dsv4attn.get_mla_metadata()[0]
    kw = dict(softmax_scale=0.07, is_fp8_kvcache=True, indices=x["a.indices"].view(3, 1, -1), attn_sink=x["sink"],
              extra_k_cache=x["b.cache"].unsqueeze(-2), extra_indices_in_kvcache=x["b.indices"].view(3, 1, -1),
              topk_length=x["lens"], impl="triton")
    head_dim_v = 512
    if change == "out shape":
        kw["out"] = torch.empty(3, 1, 64, 256, dtype=torch.bfloat16, device=device)
    elif change == "out dtype":
        kw["out"] = torch.empty(3, 1, 64, 512, dtype=torch.float32, device=device)
    elif change == "head_dim_v":
        head_dim_v = 0
    elif change == "q dtype":
        q4 = q4.float()
    else:
        kw["extra_indices_in_kvcache"] = None
    stand_ins.clear()
    with pytest.raises((TypeError, ValueError), match=name):
        dsv4attn.flash_mla_with_kvcache(q4, x["a.cache"].unsqueeze(-2), None, None, head_dim_v, meta, **kw)
    assert len(stand_ins) == 0, "a refused call launched a kernel"
    assert torch.equal(x["a.cache"], caches[0]) and torch.equal(x["b.cache"], caches[1])
    again = run(x)
    assert [(t.shape, t.stride()) for t in again] == [(t.shape, t.stride()) for t in good]
