"""Which Triton kernel specialisations a piece of code launches, found on CPU.

Triton compiles one binary per *specialisation* of a kernel: its constexpr values, the types of
its runtime arguments, and, for integers and pointers, whether they are divisible by 16 (and
integers equal to 1). Under ``TRITON_INTERPRET=1`` nothing is compiled, but every launch goes
through the interpreter, where :func:`recording` hooks in and computes the key a GPU would
compile for. Two uses: ``scripts/compile_check.py`` compiles every recorded specialisation for
real targets, and the warm-up test checks that after ``PagedAttentionEngine.warmup()`` serving
launches no specialisation the warm-up did not (none would compile while serving).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64", "uint8": "u8",
           "int8": "i8", "int16": "i16", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float64": "fp64"}


def arg_type(v: Any) -> tuple[str | None, bool]:
    """(signature type, divisible-by-16 attribute) of one runtime argument; ``(None, False)``
    for None (a constexpr to Triton)."""
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + _DTYPES[str(v.dtype).replace("torch.", "")], v.data_ptr() % 16 == 0
    if isinstance(v, bool):
        return "i1", False
    if isinstance(v, int):
        return ("i32" if -(2**31) <= v < 2**31 else "i64"), v % 16 == 0
    if isinstance(v, float):
        return "fp32", False
    if v is None:
        return None, False
    raise TypeError(type(v).__name__)


def launch_spec(fn: Any, args: tuple, kwargs: dict) -> dict:
    """The specialisation a launch of ``fn`` (the kernel's Python function) with these arguments
    compiles: module, name, signature (``"constexpr"`` for constexprs), constexpr values,
    indices of 16-divisible arguments, integer arguments equal to 1, launch options."""
    params_sig = inspect.signature(fn).parameters
    names = list(params_sig)
    params = dict(zip(names, args))
    params.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    sig, const, divisible, ones = {}, {}, [], []
    for i, n in enumerate(names):
        if n not in params:
            continue  # defaulted constexpr
        v = params[n]
        if "constexpr" in str(params_sig[n].annotation):
            const[n] = v
            sig[n] = "constexpr"
            continue
        t, div = arg_type(v)
        if t is None:
            const[n] = None
            sig[n] = "constexpr"
            continue
        sig[n] = t
        if div:
            divisible.append(i)
        if isinstance(v, int) and not isinstance(v, bool) and v == 1:
            ones.append(i)
    return dict(module=fn.__module__, name=fn.__name__, signature=sig, constexprs=const, divisible=divisible,
                ones=ones, options=options)


def spec_key(spec: dict) -> str:
    """A hashable identity of a specialisation (what decides a separate compile)."""
    return json.dumps([spec["module"], spec["name"], spec["signature"], spec["constexprs"], spec["divisible"],
                       spec["ones"], sorted(spec["options"].items())], default=str)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, dict]]:
    """Within the block, every interpreted kernel launch adds ``spec_key -> spec`` to the dict
    yielded (needs ``TRITON_INTERPRET=1`` set before Triton was imported)."""
    from triton.runtime import interpreter

    specs: dict[str, dict] = {}
    orig = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        spec = launch_spec(self.fn, args, kwargs)
        specs.setdefault(spec_key(spec), spec)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield specs
    finally:
        interpreter.InterpretedFunction.run = orig  # type: ignore[method-assign]
