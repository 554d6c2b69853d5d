"""The tools that run on the GPU still start: every benchmark's `python -m benchmarks.<name>
--smoke` (tiny sizes, the reference path on CPU) exits 0 and prints its table, every module of
scripts/ imports, and every shell script parses. The numbers themselves are only meaningful on
the GPU (docs/benchmarks.md); this guards the tools against API drift between GPU sessions (a
benchmark or script that no longer starts is found here, not on the device's clock)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
SCRIPT_MODULES = sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.sh"))


def test_the_tools_are_found():
    assert len(BENCHMARKS) >= 11 and len(SCRIPT_MODULES) >= 10 and len(SHELL_SCRIPTS) >= 5


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke_runs(name):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "| case |" in res.stdout or "|---" in res.stdout, res.stdout[-2000:]


def test_script_modules_import():
    """One process imports them all (each import pulls in torch and the kernels once)."""
    code = "import importlib\nfor m in %r:\n    importlib.import_module('scripts.' + m)\n" % (SCRIPT_MODULES,)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shell_script_parses(name):
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
