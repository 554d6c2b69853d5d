"""``python -m dsv4attn generate``: the main job's verdict, JSON output and exit status."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from dsv4attn.serving import cli  # noqa: E402


def test_help_does_no_work(monkeypatch):
    monkeypatch.setattr(cli, "generate_main", lambda args: pytest.fail("--help ran the job"))
    for argv in (["--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0


def test_tiny_check_passes_and_prints_json(capsys, tmp_path):
    prompts = [[1, 2, 3, 4, 5], list(range(130))]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prompts))
    rc = cli.main(["generate", "--tiny", "1", "--prompts", str(f), "--max-new-tokens", "5", "--check", "--json",
                   "--no-progress", "--device", "cpu", "--chunk-size", "32"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "tokens/s" in out
    outs = json.loads(out.strip().splitlines()[-1])
    assert [len(o) for o in outs] == [5, 5]
    from dsv4attn.serving.model import reference_generate
    from dsv4attn.serving.tiny import tiny_hf_model

    assert outs == reference_generate(tiny_hf_model(1), prompts, 5)


def test_prefix_cache_flag_reuses_a_shared_prompt_and_still_passes(capsys, tmp_path):
    shared = [(7 * i) % 256 for i in range(280)]
    prompts = [shared + [1, 2], shared[:260] + [3], shared + [4, 5, 6]]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prompts))
    rc = cli.main(["generate", "--tiny", "1", "--prompts", str(f), "--max-new-tokens", "3", "--check",
                   "--no-progress", "--device", "cpu", "--max-num-reqs", "1", "--max-cached-prefixes", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out
    assert "prefix cache: 2 of 3 prompts started from a cached prefix, 512 prompt tokens not computed" in out


def test_mismatch_fails_with_nonzero_exit(capsys, monkeypatch):
    from dsv4attn.serving import model as model_mod

    real = model_mod.reference_generate
    monkeypatch.setattr(model_mod, "reference_generate",
                        lambda m, p, n, progress=None: [[(t + 1) % 256 for t in o] for o in real(m, p, n)])
    rc = cli.main(["generate", "--tiny", "0", "--num-prompts", "2", "--max-new-tokens", "3", "--check",
                   "--no-progress", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip().splitlines()[-1] == "FAIL"


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "dsv4attn", "generate", "--tiny", "0", "--num-prompts", "2",
                        "--max-new-tokens", "2", "--no-progress", "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])) == 2
