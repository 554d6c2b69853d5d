"""Shared benchmark helpers: ceilings, median timing, roofline table.

Every benchmark script prints one table with the columns
``case | us (median) | TFLOP/s | GB/s | % of floor`` (plus extras), where the floor is
``max(bytes / copy_ceiling, flops / mma_ceiling)`` with the ceilings measured at the start of
the run (device-to-device copy, dense bf16 matmul), as docs/benchmarks.md requires.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

#: Fallback ceilings (H200, measured here 2026-10-28) used when --no-ceilings is given.
H200_COPY_BYTES_PER_S = 4.3e12
H200_BF16_FLOPS = 790e12


def median_us(fn, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median time of ``fn()`` in microseconds (device events on CUDA, wall clock on CPU)."""
    if torch.cuda.is_available():
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return ms * 1e3
    import statistics
    import time

    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def back_to_back_us(fn, calls: int = 100, repeats: int = 5, warmup: int = 10,
                    device_time: bool = True) -> tuple[float, float]:
    """Median and minimum over ``repeats`` of the wall time per call of ``calls`` back-to-back
    ``fn()`` calls, the device synchronised only before and after each loop: eager throughput,
    i.e. the larger of the host's and the device's time per call (``median_us`` clears L2
    before each call, and the host prepares the next call meanwhile, so it hides host time up
    to that clear's length). ``device_time=False``: the loop's closing sync is not timed, which
    gives the host's time per call while it is slower than the device."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    import statistics
    import time

    for _ in range(warmup):
        fn()
    per = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device_time:
            sync()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(per), min(per)


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: (a, b). The sweeps split a time into a fixed part and a
    part per chunk with it."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def graph_us(fn, calls: int = 1, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median device time of one ``fn()`` call, from ``calls`` calls captured in one CUDA graph and
    replayed (eager calls of small cases are bound by the host's launch cost). ``fn`` is run
    twice on a side stream first (compiles, allocator warm-up). Capture errors propagate."""
    graph = _capture(fn, calls)
    return median_us(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms) / calls


def _capture(fn, calls: int) -> "torch.cuda.CUDAGraph":
    """``calls`` calls of ``fn`` in one CUDA graph, after two calls on a side stream (compiles,
    allocator warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def interleaved_graph_us(fns: dict, calls: int = 1, rounds: int = 5, warmup_ms: float = 100.0,
                         rep_ms: float = 100.0) -> dict:
    """Per-round median device times (us per call) of each of ``fns`` (name -> callable), each
    captured as ``calls`` calls in one CUDA graph, timed in turn ``rounds`` times (the order
    reversed every other round). Each turn first runs its graph for ``warmup_ms`` and then times
    it for ``rep_ms``, so each version runs at the clock its own power draw allows (an H100 holds
    its power limit under a long tensor-core load by lowering the clock), while the rounds spread
    the card's slow drift (temperature) over every version alike; timing one version after
    another gave the later one the hotter card. Returns name -> list of ``rounds`` times."""
    graphs = {name: _capture(fn, calls) for name, fn in fns.items()}
    names = list(graphs)
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(median_us(graphs[name].replay, warmup_ms=warmup_ms, rep_ms=rep_ms) / calls)
    return times


@dataclass
class Ceilings:
    copy_bytes_per_s: float = H200_COPY_BYTES_PER_S
    mma_flops: float = H200_BF16_FLOPS

    @classmethod
    def measure(cls) -> "Ceilings":
        """Measure the copy bandwidth (bytes read + written) and the bf16 matmul rate."""
        if not torch.cuda.is_available():
            return cls()
        n = 1 << 30  # 1 GiB
        a = torch.empty(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        t_copy = median_us(lambda: b.copy_(a)) * 1e-6
        m = 8192
        x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        t_mm = median_us(lambda: x @ y) * 1e-6
        a = b = x = y = None  # free the buffers before empty_cache (the lambdas above are done)
        torch.cuda.empty_cache()
        return cls(copy_bytes_per_s=2 * n / t_copy, mma_flops=2 * m**3 / t_mm)


@dataclass
class Row:
    case: str
    us: float
    flops: float = 0.0
    bytes: float = 0.0
    extra: dict = field(default_factory=dict)


def floor_us(row: Row, ceil: Ceilings) -> float:
    return max(row.bytes / ceil.copy_bytes_per_s, row.flops / ceil.mma_flops) * 1e6


def print_table(title: str, rows: list[Row], ceil: Ceilings) -> None:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n## {title}  [{gpu}; copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 mma {ceil.mma_flops / 1e12:.0f} TFLOP/s]")
    extra_keys: list[str] = []
    for r in rows:
        for k in r.extra:
            if k not in extra_keys:
                extra_keys.append(k)
    head = ["case", "us (median)", "TFLOP/s", "GB/s", "floor us", "% of floor", *extra_keys]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        fl = floor_us(r, ceil)
        cells = [
            r.case,
            f"{r.us:.2f}",
            f"{r.flops / (r.us * 1e-6) / 1e12:.1f}" if r.flops else "-",
            f"{r.bytes / (r.us * 1e-6) / 1e9:.0f}" if r.bytes else "-",
            f"{fl:.2f}",
            f"{100 * fl / r.us:.0f}%" if fl else "-",
            *[str(r.extra.get(k, "")) for k in extra_keys],
        ]
        print("| " + " | ".join(cells) + " |")


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes; checks the script runs (CPU ok)")
    p.add_argument("--no-ceilings", action="store_true", help="use the recorded H200 ceilings")
    return p


def serving_setup(args) -> tuple:
    """``(device, dtype, ceilings)`` of the serving benchmarks: CUDA in bf16 with measured
    ceilings when present, else CPU in fp32 without; sets ``args.small`` under ``--smoke``."""
    import torch

    args.small = getattr(args, "small", False) or args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ceil = Ceilings() if args.no_ceilings or dev.type != "cuda" else Ceilings.measure()
    return dev, dtype, ceil
