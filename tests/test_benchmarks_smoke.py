"""Every benchmark script runs: `python -m benchmarks.<name> --smoke` (tiny sizes, the reference
path on CPU) exits 0 and prints its table. The numbers themselves are only meaningful on the GPU
(docs/benchmarks.md); this guards the scripts against API drift between GPU sessions (a
benchmark that no longer starts is found here, not on the device's clock)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def test_every_benchmark_is_listed():
    assert len(SCRIPTS) >= 11, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_smoke_runs(name):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "| case |" in res.stdout or "|---" in res.stdout, res.stdout[-2000:]
