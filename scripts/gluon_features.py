"""Which Gluon features for Hopper CTA clusters the installed Triton has (no GPU needed).

The h128 decode design in docs/design.md ("Next steps" 1) shares each dequantised K tile
across a cluster of two CTAs. Triton 3.9's Gluon has the pieces; this prints, for the Triton
at hand (the H200 machine runs 3.6), which of them exist, so the first device call of that work
can say whether it needs inline PTX instead.

    python -m scripts.gluon_features
"""

from __future__ import annotations

import importlib
import inspect


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _accepts(module: str, name: str, param: str) -> bool:
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    fn = getattr(fn, "__wrapped__", fn)
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def features() -> dict[str, bool]:
    """Feature name -> present in the installed Triton."""
    hopper = "triton.experimental.gluon.language.nvidia.hopper"
    core = "triton.experimental.gluon.language"
    return {
        "gl.num_ctas()": _has(core, "num_ctas"),
        "gl.barrier(cluster=...)": _accepts(core, "barrier", "cluster"),
        "hopper.cluster.barrier": _has(hopper + ".cluster", "barrier"),
        "hopper.async_store (shared-memory store across the cluster)": _has(hopper, "async_store"),
        "hopper.fence_async_shared(cluster=...)": _accepts(hopper, "fence_async_shared", "cluster"),
        "mbarrier.arrive(from_cta=...)": _accepts(hopper + ".mbarrier", "arrive", "from_cta"),
        "BlockedLayout(cga_layout=...)": _accepts(core, "BlockedLayout", "cga_layout"),
    }


def main() -> None:
    import triton

    print(f"Triton {triton.__version__}")
    for name, ok in features().items():
        print(f"  {'yes' if ok else 'no '}  {name}")


if __name__ == "__main__":
    main()
