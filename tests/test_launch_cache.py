"""dsv4attn.ops.launch_cache: the key covers what Triton specialises on, and a kept kernel is
relaunched with the arguments Triton's binder would have handed its launcher."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4attn.ops import launch_cache


def _specialise():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - depends on the Triton release
        pytest.skip("this Triton release has no native_specialize_impl")
    return lambda a: native_specialize_impl(BaseBackend, a, False, True, True)


def _samples() -> list:
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 64, 584, 1 << 20, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31,
            2**31 + 16, -(2**31), -(2**31) - 1, -(2**31) - 16, 2**40, 2**63 - 16, 2**63, 2**64 - 16]
    base = torch.zeros(256, dtype=torch.uint8)
    tensors = [base[i:].view(torch.uint8) for i in (0, 1, 2, 8, 16, 32)]
    tensors += [base[i:i + 64].view(dt) for i in (0, 2, 16) for dt in (torch.bfloat16, torch.int16)]
    tensors += [base[i:i + 64].view(dt) for i in (0, 4, 16) for dt in (torch.float32, torch.int32)]
    tensors += [base[i:i + 64].view(torch.float8_e4m3fn) for i in (0, 1, 16)]
    return ints + [True, False, 0.5, 1.0, None] + tensors


def test_key_determines_triton_specialisation():
    """Whenever two arguments get the same key, Triton specialises them the same way (so a kept
    kernel is the one Triton would have picked); and the key does not split what Triton keeps
    together for ints and tensors of one dtype more than by the properties it names."""
    spec = _specialise()
    samples = _samples()
    for a, b in itertools.product(samples, repeat=2):
        if launch_cache.arg_key(a) == launch_cache.arg_key(b):
            assert spec(a) == spec(b), (a, b)
    # What the key tells apart, Triton does too (for the values here): no needless recompiles.
    for a, b in itertools.product([x for x in samples if isinstance(x, int) and not isinstance(x, bool)], repeat=2):
        if spec(a) == spec(b):
            assert launch_cache.arg_key(a)[:3] == launch_cache.arg_key(b)[:3] or a >= 2**63 or b >= 2**63, (a, b)


def test_inlined_key_equals_per_argument_key():
    """``args_key`` (tensors and ints inlined) gives exactly ``arg_key`` of each argument,
    including tensor subclasses, bools (not ints here) and ints at every boundary."""
    samples = _samples() + [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(8))[1:]]
    assert launch_cache.args_key(tuple(samples)) == tuple(launch_cache.arg_key(a) for a in samples)
    with pytest.raises(TypeError, match="no launch-cache key"):
        launch_cache.args_key((torch.zeros(1), "x"))


def test_unsupported_argument_has_no_key():
    with pytest.raises(TypeError, match="no launch-cache key"):
        launch_cache.arg_key("x")


class _Compiled:
    """Stands in for Triton's CompiledKernel: ``compiled[grid](*all_args)`` records the launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _Kernel:
    """Stands in for a ``@triton.jit`` function: ``fn[grid](*args, **kwargs)`` records the launch and
    returns a compiled kernel."""

    def __init__(self):
        self.log = []

        def body(x_ptr, n, stride, scale, BLOCK, FLAG=True, MODE=3):
            pass

        self.fn = body

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("bound", grid, args, kwargs))
            return _Compiled(self.log)
        return run


@pytest.fixture
def cpu_cache(launches_through_cache, monkeypatch):
    monkeypatch.setattr(launch_cache, "current_device", lambda: 0)  # CPU tensors: no CUDA device asked


def test_relaunch_skips_the_binding(cpu_cache):
    k = _Kernel()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    opts = dict(BLOCK=64, MODE=5, num_warps=4)
    launch_cache.launch(k, (3,), (buf, 32, 48, 0.5), opts)
    launch_cache.launch(k, (7, 2), (buf[8:], 64, 16, 0.25), opts)  # same specialisation
    assert [e[0] for e in k.log] == ["bound", "direct"]
    # The launcher gets every parameter in signature order (constexprs given, then defaults) and
    # three grid sizes, as Triton's own launch passes them.
    assert k.log[1][1] == (7, 2, 1)
    got = k.log[1][2]
    assert got[0].data_ptr() == buf[8:].data_ptr() and got[1:] == (64, 16, 0.25, 64, True, 5)
    assert k.log[0][3] == opts


@pytest.mark.parametrize("change", ["unaligned tensor", "int one", "int not multiple of 16", "int64", "constexpr",
                                    "option"])
def test_new_specialisation_goes_through_triton(cpu_cache, change):
    k = _Kernel()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    args, opts = (buf, 32, 48, 0.5), dict(BLOCK=64, num_warps=4)
    launch_cache.launch(k, (1,), args, opts)
    args2, opts2 = {
        "unaligned tensor": ((buf[1:], 32, 48, 0.5), opts),
        "int one": ((buf, 1, 48, 0.5), opts),
        "int not multiple of 16": ((buf, 33, 48, 0.5), opts),
        "int64": ((buf, 2**31 + 16, 48, 0.5), opts),
        "constexpr": (args, dict(BLOCK=32, num_warps=4)),
        "option": (args, dict(BLOCK=64, num_warps=8)),
    }[change]
    launch_cache.launch(k, (1,), args2, opts2)
    launch_cache.launch(k, (1,), args2, opts2)
    assert [e[0] for e in k.log] == ["bound", "bound", "direct"]


def test_disabled_and_cpu_tensors_take_the_usual_path(cpu_cache, monkeypatch):
    k = _Kernel()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    for _ in range(2):
        launch_cache.launch(k, (1,), (buf, 32, 48, 0.5), dict(BLOCK=64))
    monkeypatch.setattr(launch_cache, "ENABLED", True)
    monkeypatch.setattr(launch_cache, "DEVICE_TYPES", ("cuda",))
    for _ in range(2):
        launch_cache.launch(k, (1,), (buf, 32, 48, 0.5), dict(BLOCK=64))
    assert [e[0] for e in k.log] == ["bound"] * 4


@pytest.mark.parametrize("has_fn", [True, False], ids=["jit-like", "no-python-function"])
def test_kernel_that_returns_nothing_is_not_kept(cpu_cache, has_fn):
    """A launch that returns no compiled kernel is not kept, whether or not ``fn`` has a Python
    function to read (the dispatch tests' stand-ins for the sm90 kernels have none)."""
    seen = []

    class _Fake:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(grid)

    fake = _Fake()
    if has_fn:
        fake.fn = lambda x_ptr, n: None
    for _ in range(3):
        launch_cache.launch(fake, (2,), (torch.zeros(4), 3), {"BLOCK": 4})
    assert seen == [(2,)] * 3
    # Remembered as a usual-path specialisation: later launches bind again without a new look.
    assert list(launch_cache._entries.values()) == [launch_cache._USUAL]


def test_parameter_without_value_keeps_the_usual_path(cpu_cache):
    """A constexpr neither given nor defaulted (Triton would reject the launch or bind it some
    other way) is not guessed: the specialisation keeps going through ``fn[grid]``."""
    k = _Kernel()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(3):
        launch_cache.launch(k, (1,), (buf, 32, 48, 0.5), dict(num_warps=4))  # BLOCK missing
    assert [e[0] for e in k.log] == ["bound"] * 3
    assert launch_cache.bound_tail(k, 4, dict(BLOCK=8, num_warps=4)) == (8, True, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_relaunched_attention_equals_bound_launches():
    """On the GPU: the FlashMLA-compatible decode call (sm90 or portable kernel, split-KV and
    combine at this batch) gives the same bits through the kept kernels as through Triton's
    binding, over several calls with new output buffers each time."""
    import dsv4attn
    from dsv4attn.kv_cache.layout import quantize_fp8_ds_mla

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, d, topk = 8, 64, 512, 256
    cache = quantize_fp8_ds_mla(torch.randn(b * topk // 64, 64, d, device="cuda", generator=gen).to(torch.bfloat16))
    idx = torch.randperm(b * topk, device="cuda", generator=gen).to(torch.int32).view(b, 1, topk)
    q = (torch.randn(b, 1, h, d, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    sink = torch.randn(h, device="cuda", generator=gen)
    meta, _ = dsv4attn.get_mla_metadata()

    def call():
        return dsv4attn.flash_mla_with_kvcache(q, cache.unsqueeze(-2), None, None, d, meta, softmax_scale=d**-0.5,
                                               is_fp8_kvcache=True, indices=idx, attn_sink=sink)

    launch_cache.clear()
    was = launch_cache.ENABLED
    launch_cache.ENABLED = False
    want = call()
    launch_cache.ENABLED = True
    try:
        for _ in range(3):
            got = call()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert len(launch_cache._entries) >= 1  # the kernels were kept and relaunched
    finally:
        launch_cache.ENABLED = was


def test_kept_kernels_are_bounded(cpu_cache, monkeypatch):
    """Past ``MAX_ENTRIES`` the oldest kept kernel is dropped; its next launch binds again."""
    monkeypatch.setattr(launch_cache, "MAX_ENTRIES", 2)
    k = _Kernel()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    for block in (16, 32, 64, 16):  # three specialisations, then the first (dropped) again
        launch_cache.launch(k, (1,), (buf, 32, 48, 0.5), dict(BLOCK=block))
    launch_cache.launch(k, (1,), (buf, 32, 48, 0.5), dict(BLOCK=64))  # still kept
    assert [e[0] for e in k.log] == ["bound"] * 4 + ["direct"]
    assert len(launch_cache._entries) == 2
