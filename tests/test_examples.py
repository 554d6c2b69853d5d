"""The examples run as written (a fresh process, the repository on the path) and give a verdict."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["engine_functions.py"])
def test_example_runs_and_passes(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: auto dispatch, no test-suite settings
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PASS" in res.stdout


def test_example_help_does_no_work():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_functions.py"), "--help"],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "max error" not in res.stdout and "usage" in res.stdout
