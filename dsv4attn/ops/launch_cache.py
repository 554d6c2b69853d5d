"""Relaunch a compiled Triton kernel without Triton's per-call binding (eager host cost).

``fn[grid](*args, **kwargs)`` on a ``@triton.jit`` (or Gluon) function binds every argument,
derives each one's specialisation, builds the cache key, checks the kernel's globals and only
then launches. For the attention kernels' 60-80 arguments that was about 90 us per launch on
the H200's host (under cProfile), half of an eager decode call, which is host-bound at small
batches (docs/benchmarks.md, "Host time of an eager call, profiled"). :func:`launch` does the
first launch of each specialisation the usual way, keeps the compiled kernel that Triton
returns, and launches it directly afterwards (``CompiledKernel[grid](*all_args)``, Triton's own
launcher).

A specialisation is what Triton 3.6-3.9 derive from the arguments (``native_specialize_impl``):
per tensor its dtype and whether its address is a multiple of 16; per int whether it equals 1
(then a constant), whether it is a multiple of 16, and its width (i32 / i64 / u64); per bool,
float and None only the kind. :func:`arg_key` keeps exactly these properties (a test checks it
against Triton's own function), so two launches with equal keys run the same binary. The
constexprs and launch options are part of the key as given.

Only CUDA launches go through the cache; the interpreter and CPU take the usual path.

On by default since it ran on a GPU (H100, 2026-12-06, docs/benchmarks.md Table 61): with
every attention launch through it, the attention suites (198 tests) and the GPU tests of the
CUDA-graph, speculative, layer-runner and prefix-caching paths passed, and its own GPU test
compares relaunched attention with bound launches bit for bit. ``DSV4ATTN_LAUNCH_CACHE=0`` in the environment (or
``ENABLED = False``) turns it off. The key is checked against Triton's own specialisation (3.6
and 3.9) on CPU (tests/test_launch_cache.py).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from dsv4attn.ops import call_plan

#: Relaunch compiled kernels directly (False: every launch through ``fn[grid](...)``).
#: ``DSV4ATTN_LAUNCH_CACHE=0`` in the environment turns it off for the process.
ENABLED = os.environ.get("DSV4ATTN_LAUNCH_CACHE", "1") != "0"
#: Specialisations kept (the oldest dropped first): a serving process meets a handful per
#: kernel (the warm-up, docs/serving.md, makes them finite).
MAX_ENTRIES = 512

#: Device types whose launches go through the cache (the tests add "cpu" with a stand-in kernel).
DEVICE_TYPES = ("cuda",)

_I32 = 2**31
_U63 = 2**63
_entries: dict = {}
#: What a specialisation that cannot be relaunched is kept as: its launches take the usual path.
_USUAL = ("usual path",)


def current_device() -> int:
    """The device Triton compiles and launches for (its driver's current device)."""
    return torch.cuda.current_device()


def clear() -> None:
    """Forget every kept kernel (tests), and the call plans that launch them."""
    _entries.clear()
    call_plan.clear()


def arg_key(a: Any) -> Any:
    """The properties of one runtime argument that Triton specialises a kernel on."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return "u1"
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32, a < _U63)
    if isinstance(a, float):
        return "fp32"
    if a is None:
        return None
    raise TypeError(f"no launch-cache key for an argument of type {type(a).__name__}")


def args_key(args: tuple) -> tuple:
    """``tuple(arg_key(a) for a in args)`` with the two common kinds (tensors and ints) inlined:
    the key is built on every launch, and the attention kernels take 50-60 arguments (13 us per
    launch through :func:`arg_key`, 8 us inlined, on this project's CPU)."""
    tensor = torch.Tensor
    return tuple([(a.dtype, not a.data_ptr() & 15) if a.__class__ is tensor
                  else (a == 1, not a & 15, -_I32 <= a < _I32, a < _U63) if a.__class__ is int
                  else arg_key(a) for a in args])


@functools.lru_cache(maxsize=256)
def _params(py_fn) -> tuple:
    """(name, default) of each parameter of a kernel's Python function ``py_fn`` in order (read
    once per kernel; keyed by the function object, since hashing a JITFunction computes its
    cache key, which the interpreter's kernels cannot)."""
    return tuple((p.name, p.default) for p in inspect.signature(py_fn).parameters.values())


def bound_tail(fn, num_args: int, consts: dict) -> tuple:
    """The values Triton's launcher takes after the ``num_args`` leading runtime arguments of
    ``fn``: each later parameter from ``consts`` or its default (``inspect.Parameter.empty``
    where it has neither). Launch options in ``consts`` (``num_warps``) are no parameters and
    are ignored."""
    return tuple(consts[n] if n in consts else d for n, d in _params(fn.fn)[num_args:])


def _launch_usual(fn, grid: tuple, args: tuple, kwargs: dict, usual: Callable[[], Any] | None) -> Any:
    """One launch the usual way (``usual``, else Triton's binding launch); the compiled kernel."""
    return fn[grid](*args, **kwargs) if usual is None else usual()


def launch(fn, grid: tuple, args: tuple, kwargs: dict, usual: Callable[[], Any] | None = None) -> None:
    """``fn[grid](*args, **kwargs)``; after the first launch of a specialisation, the compiled
    kernel is launched directly. ``args``: the kernel's leading parameters, positional;
    ``kwargs``: constexprs and the launch options (``num_warps``, ``num_stages``). A call plan
    being recorded (:mod:`dsv4attn.ops.call_plan`) is told of each launch.

    ``usual``: where ``fn[grid](...)`` is not how this kernel is launched (the two-CTA cluster,
    whose compiled kernel gets launch metadata of its own), what launches it instead, returning
    the compiled kernel; that kernel is then kept and relaunched on ``grid`` like any other."""
    first = args[0] if args else None
    if not ENABLED or not isinstance(first, torch.Tensor) or first.device.type not in DEVICE_TYPES:
        call_plan.not_plannable()
        _launch_usual(fn, grid, args, kwargs, usual)
        return
    try:
        # Triton compiles for the current device (not the tensors'), so that is the one keyed.
        key = (fn, current_device(), tuple(kwargs.items()), args_key(args))
        hit = _entries.get(key)  # the key's one hash on a relaunch
    except TypeError:  # an argument the key does not cover: the usual path
        call_plan.not_plannable()
        _launch_usual(fn, grid, args, kwargs, usual)
        return
    if hit is None:
        compiled = _launch_usual(fn, grid, args, kwargs, usual)
        if hasattr(compiled, "result"):
            call_plan.not_plannable()
            return  # still compiling (a future): kept once a later launch returns the kernel
        # Nothing to relaunch (no compiled kernel returned), or a parameter Triton bound some
        # other way: the usual path from now on. The signature is read only for a kernel to keep.
        entry: tuple = _USUAL
        if compiled is not None and hasattr(compiled, "__getitem__"):
            tail = bound_tail(fn, len(args), kwargs)
            if all(v is not inspect.Parameter.empty for v in tail):
                entry = (compiled, tail)
        if len(_entries) >= MAX_ENTRIES:
            try:  # the oldest; it costs one bound launch if it comes back
                _entries.pop(next(iter(_entries)), None)
            except (RuntimeError, StopIteration):  # another thread changed the dict meanwhile
                pass
        _entries[key] = entry
        if entry is _USUAL:
            call_plan.not_plannable()
        elif call_plan.active():
            call_plan.note_launch(entry[0], grid, [*args, *entry[1]])
        return
    if hit is _USUAL:
        call_plan.not_plannable()
        _launch_usual(fn, grid, args, kwargs, usual)
        return
    compiled, tail = hit
    if call_plan.active():
        call_plan.note_launch(compiled, grid, [*args, *tail])
    compiled[(tuple(grid) + (1, 1))[:3]](*args, *tail)  # Triton's launcher takes three grid sizes
