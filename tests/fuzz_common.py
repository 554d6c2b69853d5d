"""Shared machinery of the fuzz suites (tests/test_fuzz_*.py): bad-input mutations of a valid
call and the two checks every public entry point must pass.

A *mutation* replaces one argument of a valid call. Its expectation is either

- ``"refuse"``: a ``TypeError`` or ``ValueError`` whose message names the argument, raised before
  any state changes (every tensor the call may write is bit-identical afterwards), or
- ``"same"``: the call succeeds and writes exactly what the unmutated call writes (a strided view
  of the same values must never be read as if it were contiguous).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

REFUSED = (TypeError, ValueError)
INT32_MAX = 2**31 - 1
#: dtypes tried in place of an argument's own (those the argument accepts are skipped).
DTYPES = (torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool, torch.int32, torch.int64)


@dataclass
class Mutation:
    arg: str
    label: str
    make: Callable[[Any], Any]  # valid value -> mutated value
    expect: str  # "refuse" | "same"
    name: str | None = None  # text the error must contain (default: arg)

    def __repr__(self) -> str:
        return f"{self.arg}:{self.label}"


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every dim's stride doubled along the last)."""
    if t.dim() == 0:
        return t
    wide = torch.stack([t, torch.zeros_like(t)], dim=-1)
    return wide[..., 0]


def tensor_mutations(arg: str, allowed: Sequence[torch.dtype], *, exact_len: bool = True, ndim_free: bool = False,
                     bounds: tuple[int | None, int | None] | None = None, strided_same: bool = True,
                     output: bool = False, optional: bool = False) -> list[Mutation]:
    """The mutations of a tensor argument: type, dtype, rank, device, length, strides, values.

    ``bounds``: the allowed value range of an index tensor (element 0 set just outside it, and to
    the int32 extremes). ``output``: a buffer the call writes (strided views must be refused or
    written exactly as a contiguous buffer would; here: refused unless rows stay unit-stride).
    """
    muts = [
        Mutation(arg, "list", lambda t: t.tolist(), "refuse"),
        Mutation(arg, "None", lambda t: None, "refuse") if not (output or optional) else None,
        Mutation(arg, "meta device", lambda t: torch.empty_like(t, device="meta"), "refuse"),
    ]
    for dt in DTYPES:
        if dt not in allowed:
            muts.append(Mutation(arg, f"dtype {dt}", lambda t, dt=dt: t.to(dt), "refuse"))
    if not ndim_free:
        muts.append(Mutation(arg, "extra dim", lambda t: t.unsqueeze(0), "refuse"))
    if exact_len:
        muts.append(Mutation(arg, "one longer", lambda t: torch.cat([t, t[:1]]) if t.shape[0] else t.new_zeros(1),
                             "refuse"))
    if strided_same and not output:
        muts.append(Mutation(arg, "strided view", strided, "same"))
    if output:
        muts.append(Mutation(arg, "strided rows", strided, "refuse"))
    if bounds is not None:
        lo, hi = bounds

        def setv(v: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def f(t: torch.Tensor) -> torch.Tensor:
                t = t.clone()
                t.view(-1)[0] = v
                return t
            return f

        if lo is not None:
            muts.append(Mutation(arg, f"value {lo - 1}", setv(lo - 1), "refuse"))
            muts.append(Mutation(arg, "value -2^31", setv(-(2**31)), "refuse"))
        if hi is not None:
            muts.append(Mutation(arg, f"value {hi + 1}", setv(hi + 1), "refuse"))
            muts.append(Mutation(arg, "value 2^31-1", setv(INT32_MAX), "refuse"))
    return [m for m in muts if m is not None]


def int_mutations(arg: str, bad: Sequence[Any], *, name: str | None = None) -> list[Mutation]:
    """Refused values of an int argument: not an int, bool, float, and the given bad values."""
    muts = [Mutation(arg, "str", lambda v: "3", "refuse", name), Mutation(arg, "float", lambda v: 2.5, "refuse", name),
            Mutation(arg, "bool", lambda v: True, "refuse", name), Mutation(arg, "None", lambda v: None, "refuse", name)]
    muts += [Mutation(arg, f"= {b}", lambda v, b=b: b, "refuse", name) for b in bad]
    return muts


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def check_mutation(fn: Callable[..., Any], kwargs: dict[str, Any], state: Sequence[torch.Tensor],
                   mutation: Mutation, baseline: Sequence[bytes] | None = None) -> None:
    """Apply ``mutation`` to ``kwargs[mutation.arg]`` and check its expectation (module doc).

    ``state``: every tensor the call may write (caches, outputs), compared bit for bit;
    ``baseline``: their bytes after the unmutated call (needed for ``"same"``).
    """
    args = dict(kwargs)
    args[mutation.arg] = mutation.make(args[mutation.arg])
    before = [_bits(s) for s in state]
    if mutation.expect == "refuse":
        with pytest.raises(REFUSED) as info:
            fn(**args)
        want = mutation.name or mutation.arg
        assert want in str(info.value), f"{mutation!r}: the error does not name {want!r}: {info.value}"
        after = [_bits(s) for s in state]
        assert after == before, f"{mutation!r}: state changed before the error"
    else:
        fn(**args)
        assert baseline is not None
        assert [_bits(s) for s in state] == list(baseline), f"{mutation!r}: result differs from the plain call"
