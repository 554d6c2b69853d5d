"""Plans of repeated attention calls: validation and launch set-up once per call signature.

An eager decode call is host-bound at small batches: after the launch cache
(:mod:`dsv4attn.ops.launch_cache`) most of its host time is this library's own Python, i.e.
validating ~10 tensors, resolving layouts and the kernel config, and assembling 60-argument
launch lists (docs/design.md, "Host overhead"). All of that is a pure function of what a
:func:`signatures` holds (per tensor: class, dtype, device, shape, strides and the low 4 bits of
its address; the scalar arguments with their types): two calls with equal signatures pass or
fail the same checks and launch the same kernels with the same integer arguments, on other
addresses.

So an entry point (:func:`dsv4attn.ops.sparse_attn.sparse_mla_forward`, the FlashMLA-compatible
functions) takes its checked path the first two times a signature comes, and at the second
:func:`recording` notes what that path allocates (:func:`empty`) and launches (the launch
cache reports each launch). If every launch went to a compiled kernel and every tensor argument
was one of the call's own tensors (its ``roles``: q, sink, out, the sets' tensors, in an order
each entry point fixes) or one it allocated, the result is a :class:`CallPlan` kept under the
signature. Later calls with that signature run the plan: the same allocations, then each kernel
launched with the new tensors' addresses in the same argument positions. Nothing is kept for a
call whose checks failed, so a plan's signature is one that passed them.

The plans follow the launch cache: on when it is on, forgotten when it is cleared or when a
kernel falls back (``dsv4attn.ops.sparse_attn_launch`` clears them then). Like the per-shape
caches of ``sparse_attn_launch`` (its config LRU), a plan assumes the dispatch policy stays
fixed for the process: code that changes it (a test patching ``kernel_config``) clears them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

#: Use plans (False: every call takes the checked path; ``scripts/host_overhead.py`` times both).
#: They are used only while the launch cache is on too.
ENABLED = True
#: Launch planned kernels through Triton's launcher itself, without the runner closure of
#: ``CompiledKernel[grid]`` (False: through the runner; ``scripts/host_overhead.py`` times both).
#: On: on an H200 (docs/benchmarks.md, Table 65) planned calls launched this way are bit for bit
#: the checked calls (tests/test_call_plan.py runs them both ways) and take 2-7 us less host time
#: than through the runner. ``DSV4ATTN_DIRECT_LAUNCH=0`` in the environment turns it off for the
#: process.
DIRECT = os.environ.get("DSV4ATTN_DIRECT_LAUNCH", "1") != "0"
#: Plans kept (the oldest dropped first); a serving process meets a few per entry point.
MAX_PLANS = 512

_plans: dict = {}
#: Signatures met once, not planned yet (a plan is recorded at a signature's second call).
_seen: dict = {}
_local = threading.local()


def signatures(args: Iterable) -> tuple:
    """What the checks and launch decisions read of each argument: per tensor its class, dtype,
    device, shape, strides and address modulo 16 (alignment checks and Triton's 16-byte
    specialisation); ``None`` stays ``None``; other objects are kept as (class, value). One
    comprehension: an entry point's key takes 16-20 of them per call, on the eager path."""
    tensor = torch.Tensor
    return tuple([(a.__class__, a.dtype, a.device, a.shape, a.stride(), a.data_ptr() & 15) if isinstance(a, tensor)
                  else None if a is None else (a.__class__, a) for a in args])


def get(key: Any) -> Any:
    """What :func:`keep` kept under ``key``; None if nothing, or if ``key`` is unhashable (an
    argument such as a bad layout object: no plan serves it, and the checks name it)."""
    try:
        return _plans.get(key)
    except TypeError:
        return None


def clear() -> None:
    """Forget every plan (the launch cache's ``clear`` and kernel fallbacks call this)."""
    _plans.clear()
    _seen.clear()


def seen_before(key: Any) -> bool:
    """Whether a call with signature ``key`` came before (since the last :func:`clear`); notes
    this one. An entry point records a plan only then, so a signature met once (a one-off
    shape) costs no recording (about half again the checked path's host time on CPU)."""
    try:
        if key in _seen:
            return True
    except TypeError:  # unhashable: never planned (see get)
        return False
    _remember(_seen, key, True)
    return False


class CallPlan:
    """The allocations and launches of one call signature, replayed on new tensors.

    ``allocs``: ``(shape, strides, dtype)`` of each tensor the call allocates, on the call's
    device, appended to the roles in order (contiguous as recorded; :meth:`shaped` may give an
    output the strides of a wrapper's view of it); ``launches``: per kernel launch the runner
    Triton's compiled kernel returns for its grid, the parts to call its launcher directly
    (:func:`_direct`, or None), the argument list with the tensor positions blank, and
    ``(position, role)`` pairs to fill with addresses; ``outputs``: the roles returned.
    ``role_ptrs``: the recording call's role addresses (a wrapper checks its own roles against
    them before it keeps this plan under its own signature). ``views``: ``(index, byte offset)``
    of each tail of an allocation the call launched with (:func:`tail`), numbered after the
    allocations; a launch argument names them by that number, never an output."""

    __slots__ = ("allocs", "launches", "outputs", "role_ptrs", "device", "stream_source", "views")

    def __init__(self, allocs: tuple, launches: tuple, outputs: tuple, role_ptrs: tuple,
                 device: torch.device, views: tuple = ()) -> None:
        self.allocs, self.launches, self.outputs = allocs, launches, outputs
        self.role_ptrs, self.device, self.views = role_ptrs, device, views
        # Direct launches only when every launch has its launcher's parts (real compiled kernels).
        self.stream_source = _stream_source() if launches and all(d is not None for _, d, _, _ in launches) else None

    def run(self, roles: list) -> list:
        """Allocate, launch every kernel on ``roles`` (the call's tensors in the order its
        entry point fixes, ``None`` where absent) and return the output tensors (``None``
        where the call returns none)."""
        device = self.device
        tensors = roles + [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                           for shape, strides, dtype in self.allocs]
        ptrs = [0 if t is None else t.data_ptr() for t in tensors]
        for base, offset in self.views:
            ptrs.append(ptrs[base] + offset)
        source = self.stream_source
        direct = source is not None and DIRECT and hooks_idle()
        # Triton's launcher straight away, on the current stream (looked up once per call)
        stream = source[0](source[1]) if source is not None and direct else None
        for runner, parts, template, slots in self.launches:
            args = template.copy()
            for pos, role in slots:
                args[pos] = ptrs[role]
            if direct:
                run, gx, gy, gz, function, meta = parts
                run(gx, gy, gz, stream, function, meta, None, None, None, *args)
            else:
                runner(*args)
        return [None if i is None else tensors[i] for i in self.outputs]

    def shaped(self, made: Sequence, finals: Sequence, roles: Sequence) -> CallPlan | None:
        """This plan returning its outputs in the shapes a wrapper gives them, with no view made
        per call. ``made``: the outputs of the call that recorded it (None where absent);
        ``finals``: the wrapper's view of each (a reshape, a transpose); ``roles``: that call's
        roles. An allocated output is then allocated in its final shape and strides, which must
        cover the allocation exactly (every element at the same byte, so each launch argument
        stands); an output that is a role is returned as the caller's tensor, so its final must
        be that tensor's own shape and strides (which the signature fixes). None otherwise."""
        allocs, n_roles = list(self.allocs), len(self.role_ptrs)
        for i, m, f in zip(self.outputs, made, finals, strict=True):
            if i is None or m is None or f is None:
                if not (i is None and m is None and f is None):
                    return None
                continue
            if f.data_ptr() != m.data_ptr():
                return None
            shape, strides = tuple(f.shape), f.stride()
            if i < n_roles:
                if (tuple(roles[i].shape), roles[i].stride()) != (shape, strides):
                    return None
                continue
            numel = f.numel()
            span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
            if not (m.is_contiguous() and numel == m.numel() == span > 0 and min(strides, default=0) >= 0):
                return None
            allocs[i - n_roles] = (shape, strides, allocs[i - n_roles][2])
        return CallPlan(tuple(allocs), self.launches, self.outputs, self.role_ptrs, self.device, self.views)


class _Recording:
    def __init__(self, roles: Sequence) -> None:
        self.roles = list(roles)
        self.allocs: list = []
        self.views: list = []
        self.launches: list = []
        self.ok = True


@contextlib.contextmanager
def recording(roles: Sequence) -> Iterator[_Recording]:
    """Note what this thread's call allocates and launches inside the block; ``roles``: its
    tensors in the entry point's order. :func:`finish` makes the plan."""
    rec = _Recording(roles)
    _local.rec = rec
    try:
        yield rec
    finally:
        _local.rec = None


def take_last() -> CallPlan | None:
    """The plan the last :func:`finish` on this thread made (None if it made none), once."""
    plan, _local.last = getattr(_local, "last", None), None
    return plan


def active() -> bool:
    """Whether a recording is under way on this thread (the launch cache asks before noting)."""
    return getattr(_local, "rec", None) is not None


def empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, noted by a recording under way."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.allocs.append((tuple(shape), dtype, t))
    return t


def tail(base: torch.Tensor, start: int) -> torch.Tensor:
    """``base[start:]`` of a 1-D tensor from :func:`empty`, noted by a recording under way: one
    allocation can hold several scratch buffers (a plan then passes the tail's address as the
    allocation's plus a fixed offset, with no view made on a planned call)."""
    t = base[start:]
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.views.append((t, base, start * base.element_size()))
    return t


def note_launch(compiled: Any, grid: tuple, args: Sequence) -> None:
    """A launch of ``compiled`` (a compiled kernel whose ``[grid]`` gives its launcher; None:
    launched some other way, so nothing can be planned) with every argument it takes, in order."""
    rec = getattr(_local, "rec", None)
    if rec is None:
        return
    if compiled is None:
        rec.ok = False
        return
    rec.launches.append((compiled, (tuple(grid) + (1, 1))[:3], list(args)))


def not_plannable() -> None:
    """The call under way does something a plan cannot replay (e.g. a launch outside the cache)."""
    rec = getattr(_local, "rec", None)
    if rec is not None:
        rec.ok = False


def finish(rec: _Recording, key: Any, outputs: Sequence, device: torch.device) -> CallPlan | None:
    """End ``rec``; keep and return its plan under ``key`` when the call can be replayed
    (``outputs``: the tensors the call returns, ``None`` where absent), else None. The plan is
    also what :func:`take_last` returns next."""
    _local.rec = None
    _local.last = plan = _plan(rec, outputs, device)
    if plan is not None:
        keep(key, plan)
    return plan


def _plan(rec: _Recording, outputs: Sequence, device: torch.device) -> CallPlan | None:
    if not rec.ok or not rec.launches:
        return None
    tensors = rec.roles + [t for _, _, t in rec.allocs]
    where = {id(t): i for i, t in enumerate(tensors) if t is not None}
    if len(where) != sum(t is not None for t in tensors):
        return None  # one tensor in two roles: which one a launch argument stands for is unknown
    views: list[tuple[int, int]] = []
    for t, base, offset in rec.views:
        if id(base) not in where or id(t) in where:
            return None  # a tail of a tensor the plan cannot name
        where[id(t)] = len(tensors) + len(views)
        views.append((where[id(base)], offset))
    launches = []
    for compiled, grid, args in rec.launches:
        template, slots = [], []
        for pos, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                role = where.get(id(a))
                if role is None:  # a tensor the plan could not name again (a copy, a scratch)
                    return None
                slots.append((pos, role))
                a = 0
            template.append(a)
        runner = compiled[grid]  # loads the kernel: its launcher and function exist from here on
        launches.append((runner, _direct(compiled, grid), template, tuple(slots)))
    outs = []
    for t in outputs:
        if t is not None and where.get(id(t), len(tensors)) >= len(tensors):
            return None  # not a role or an allocation (a tail is never returned)
        outs.append(None if t is None else where[id(t)])
    return CallPlan(tuple((shape, t.stride(), dtype) for shape, dtype, t in rec.allocs), tuple(launches), tuple(outs),
                    tuple(0 if t is None else t.data_ptr() for t in rec.roles), device, tuple(views))


def _direct(compiled: Any, grid: tuple) -> tuple | None:
    """What Triton's runner (``compiled[grid]``, the closure its ``CompiledKernel`` returns)
    passes its launcher besides the stream and the kernel's arguments, found once:
    ``(launcher, grid x, y, z, function, packed metadata)``; None where ``compiled`` has no
    such parts (a stand-in). The runner looks up the current device and stream and builds
    launch metadata for the launch hooks on every launch; a plan looks up the stream once per
    call and passes no metadata while no launch hook is set (:func:`hooks_idle`)."""
    run, function = getattr(compiled, "run", None), getattr(compiled, "function", None)
    if run is None or function is None or not hasattr(compiled, "packed_metadata"):
        return None
    return (run, grid[0], grid[1], grid[2], function, compiled.packed_metadata)


def _stream_source() -> tuple:
    """(get_current_stream, current device index) as Triton's runner finds them. The device is
    fixed for a plan: the current device is part of every plan's signature."""
    from triton.runtime.driver import driver

    active = driver.active
    return active.get_current_stream, active.get_current_device()


def hooks_idle() -> bool:
    """Whether no Triton launch hook is set (a profiler such as Proton sets them): only then do
    plans launch without the runner's launch metadata. Triton 3.6-3.9 keep each hook as a
    chain of callables (``HookChain``), older releases as a callable or None."""
    runtime = _triton_runtime()
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


@functools.lru_cache(maxsize=1)
def _triton_runtime() -> Any:
    from triton import knobs

    return knobs.runtime


def _idle(hook: Any) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def keep(key: Any, plan: Any) -> None:
    """Keep ``plan`` (a :class:`CallPlan`, or an entry point's own record around one) under
    ``key``, dropping the oldest beyond :data:`MAX_PLANS`."""
    _remember(_plans, key, plan)


def _remember(table: dict, key: Any, value: Any) -> None:
    try:
        hash(key)
    except TypeError:  # unhashable: nothing to remember it by (get finds nothing either)
        return
    if len(table) >= MAX_PLANS:
        try:  # the oldest
            table.pop(next(iter(table)), None)
        except (RuntimeError, StopIteration):  # another thread changed the dict meanwhile
            pass
    table[key] = value
