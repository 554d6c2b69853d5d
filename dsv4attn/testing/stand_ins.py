"""Stand-ins for the attention kernels, so host-side code (dispatch, launch caches, call plans)
runs and is timed without a GPU: :func:`replace_attention_kernels` swaps every kernel the
attention ops launch for what ``wrap`` makes of it, optionally making dispatch take the sm90
Gluon kernels as on Hopper. Used by ``tests/test_call_plan.py`` and ``scripts/host_overhead.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replace_attention_kernels(wrap: Callable[[Any], Any], sm90: bool = False,
                              set_attr: Callable[[Any, str, Any], None] = setattr, *,
                              compiled: Callable[[], Any]) -> None:
    """Replace the portable attention kernels (decode, combine, prefill) by ``wrap(kernel)``.
    With ``sm90``, dispatch also answers that the sm90 kernels are available and takes
    ``wrap`` of each (the stand-ins keep the real parameter lists, which the launch cache reads),
    and the two-CTA cluster kernel (65-128 heads on fp8 pages) is built as ``compiled()``: what a
    stand-in's ``kernel[grid](...)`` returns, since there is nothing to compile.
    ``set_attr``: how attributes are set (``monkeypatch.setattr`` in tests, so they are undone).
    The cached launch configurations are cleared, since they depend on the sm90 answer."""
    from dsv4attn.kernels import sparse_attn as k
    from dsv4attn.kernels import sparse_attn_prefill as kp
    from dsv4attn.ops import sparse_attn_launch as sl

    set_attr(k, "_sparse_mla_attn_kernel", wrap(k._sparse_mla_attn_kernel))
    set_attr(k, "_sparse_mla_combine_kernel", wrap(k._sparse_mla_combine_kernel))
    set_attr(kp, "_sparse_mla_prefill_kernel", wrap(kp._sparse_mla_prefill_kernel))
    if sm90:
        real = {ws: sl._sm90_kernel(ws) for ws in (False, True)}
        stand = {ws: (wrap(kern), warps) for ws, (kern, warps) in real.items()}
        set_attr(sl, "sm90_kernel_available", lambda dev: True)
        set_attr(sl, "_sm90_kernel", lambda ws, qreg=False: stand[ws])
        set_attr(sl, "_cluster_kernel", lambda kernel, warps, grid, args, consts: compiled())
    sl._cached_config.cache_clear()
