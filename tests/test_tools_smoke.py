"""The tools that run on the GPU still start: every benchmark's `python -m benchmarks.<name>
--smoke` (tiny sizes, the reference path on CPU) exits 0 and prints its table, every module of
scripts/ imports, and every shell script parses. The numbers themselves are only meaningful on
the GPU (docs/benchmarks.md); this guards the tools against API drift between GPU sessions (a
benchmark or script that no longer starts is found here, not on the device's clock)."""

import os
import re
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


def test_host_overhead_plans_calls_on_cpu_stand_ins():
    """``scripts.host_overhead --planned`` times planned calls: each entry point in its four
    modes, and plans were kept for all three (the op's, among them those of the FlashMLA entry
    points' inner calls, and one per FlashMLA entry point)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "scripts.host_overhead", "--planned", "--calls", "5", "--repeats", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    for entry in ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "sparse_mla_attention"):
        for mode in ("plans direct", "plans runner", "plans off", "cache off"):
            assert any(line.startswith(entry) and mode in line for line in res.stdout.splitlines()), (entry, mode)
    kept = re.search(r"plans kept: (\d+) of the op, (\d+) of FlashMLA's entry points", res.stdout)
    assert kept is not None and int(kept[1]) >= 1 and int(kept[2]) == 2, res.stdout


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shell_script_parses(name):
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_vs_flashmla_decode_sweep_fits_each_library(tmp_path):
    """``bench_vs_flashmla --decode-sweep`` fits each library's decode time as fixed + chunks x
    per chunk: on CPU (dsv4attn only, two chunk counts) the fit passes through both points, and
    its least-squares fit recovers a line exactly from three points on it."""
    from benchmarks.common import line_fit

    assert line_fit([2.0, 5.0, 9.0], [7.0, 13.0, 21.0]) == pytest.approx((3.0, 2.0))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "sweep.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_vs_flashmla", "--smoke", "--decode-sweep", "--json",
                          str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    import json

    fits = json.loads(out.read_text())
    assert [f["library"] for f in fits] == ["dsv4attn"], fits
    pts = fits[0]["points"]
    assert [c for c, _ in pts] == [2, 3]
    for c, t in pts:
        assert fits[0]["fixed_us"] + c * fits[0]["per_chunk_us"] == pytest.approx(t, rel=1e-9)


def test_ws_sass_counts_the_kernels_loops_offline():
    """``scripts.ws_sass`` compiles the warp-specialised kernel's prefill form for sm_90a with the
    installed Triton and its bundled ptxas / nvdisasm, and finds the three partitions' loops and
    the logits warpgroup's window (Table 88's census, without a GPU)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # a compile for sm_90a, not the interpreter the suite runs under
    res = subprocess.run([sys.executable, "-m", "scripts.ws_sass"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    assert "spill" in out and "registers" in out, out
    loops = {ln.split(":")[0]: int(ln.split(": ")[1].split()[0]) for ln in out.splitlines() if "per iteration" in ln}
    assert set(loops) == {"logits warpgroup", "P V warpgroup", "producer"}, out
    window = re.search(r"window \(logits done -> P V issued\): (\d+) instructions", out)
    assert window is not None and 0 < int(window[1]) < loops["logits warpgroup"], out
