"""The examples/ scripts run as written."""

import pathlib
import runpy

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["model_generate.py", "layer_runner.py"])
def test_example_runs(name):
    runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
