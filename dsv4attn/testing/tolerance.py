"""Tolerance rules of the test suite, written once.

Two rules, each with its justification:

- fp32 parity (:func:`assert_close_rel`): both sides compute the same formulas in fp32 with
  different summation orders, so the error is a few ulps of the largest magnitude involved:
  the max-abs error is bounded relative to the reference's max-abs value (``rel`` 1e-5 for one
  layer, 1e-4 after caches and chunking add rounding steps).
- reduced precision (:func:`assert_within_reference_error`): a bf16/fp8 run cannot be compared
  to fp32 with a fixed tolerance; it must be at most ``factor`` times as far from the fp32 gold
  as the reference's own bf16 run is.

``skip`` (bool ``[T]``) drops tokens whose indexer top-k has a tie at the selection boundary:
any tie-break is correct there and the reference's is arbitrary.
"""

from __future__ import annotations

import torch


def _select(got: torch.Tensor, want: torch.Tensor, skip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: got {tuple(got.shape)}, want {tuple(want.shape)}")
    if skip is not None:
        keep = ~skip.detach().cpu().bool()
        got, want = got[keep], want[keep]
    return got, want


def max_rel_err(got: torch.Tensor, want: torch.Tensor, skip: torch.Tensor | None = None) -> float:
    """``max|got - want| / max(max|want|, 1e-6)`` over the tokens not skipped (NaN counts as inf)."""
    got, want = _select(got, want, skip)
    if got.numel() == 0:
        return 0.0
    diff = (got - want).abs()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return diff.max().item() / max(want.abs().max().item(), 1e-6)


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5,
                     skip: torch.Tensor | None = None) -> None:
    """Assert ``max|got - want| <= rel * max|want|`` (the fp32 parity rule of the module doc)."""
    err = max_rel_err(got, want, skip)
    assert err <= rel, f"max abs error is {err:.3g} x the reference's scale (allowed {rel:g})"


def assert_within_reference_error(got: torch.Tensor, ref_low: torch.Tensor, gold: torch.Tensor,
                                  factor: float = 2.0, check_max: bool = True) -> None:
    """The reduced-precision rule: ``mean|got - gold| <= factor * mean|ref_low - gold|`` and, with
    ``check_max``, the same for the max. ``ref_low`` is the reference run in the same reduced
    precision, ``gold`` the fp32 reference (all the same shape)."""
    g, gold_c = _select(got, gold, None)
    r, _ = _select(ref_low, gold, None)
    if g.numel() == 0:
        return
    e, e_ref = (g - gold_c).abs(), (r - gold_c).abs()
    assert e.mean() <= factor * e_ref.mean(), (
        f"mean abs error {e.mean().item():.3g} exceeds {factor:g} x the reference's own {e_ref.mean().item():.3g}")
    if check_max:
        assert e.max() <= factor * e_ref.max(), (
            f"max abs error {e.max().item():.3g} exceeds {factor:g} x the reference's own {e_ref.max().item():.3g}")
