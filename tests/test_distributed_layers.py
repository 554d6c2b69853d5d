"""TP 2 and DCP 2 equal one process: two real processes over torch.distributed.

One module fixture spawns two processes (gloo on CPU; NCCL on two GPUs for the ``gpu`` variant)
that run :func:`dsv4attn.distributed.selfcheck.spawn_worker`: every layer kind (sliding, CSA
r=4, HCA r=128) through a plan of mixed prefill chunks and decodes of several interleaved
requests, once in a single-process ``AttentionRunner`` and once in this rank's TP / DCP runner.
The oracle is the single-process runner (itself tested against transformers in
test_layer_runner.py). fp32 tolerance 1e-5 of the output's max (observed ~5e-7: the parallel
paths only reorder fp32 sums); bf16 (GPU only) follows the 2x rule against the fp32 single
process. The "reserved" cases start a request at position 700 over zero pages (the benchmarks'
never-run context) in both runs; the "fp8" cases use fp8_ds_mla pages (SWA, compressed KV and
indexer keys) in both runs. The memory cases run one 2048-token request: each rank must hold at most half the
compressed-cache bytes of one process plus one partial block per cache.

A last test starts the command-line check under torchrun with 4 gloo processes, TP 2 x DCP 2
(both parallelisms at once: the TP shard's all-reduce inside the DCP runner), sliding and CSA
layers (HCA adds no new path to the combination and most of the time).

GPU command (two GPUs): ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1 python3 -m pytest -q -m gpu tests/test_distributed_layers.py``.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dsv4attn.distributed.selfcheck import spawn_worker

TP_CASES = ["tp2-dcp1-sliding", "tp2-dcp1-csa", "tp2-dcp1-hca", "tp2-dcp1-sliding-6heads-3groups"]
DCP_CASES = ["tp1-dcp2-sliding", "tp1-dcp2-csa", "tp1-dcp2-hca", "dcp-interleave2-csa", "dcp-interleave2-hca",
             "tp1-dcp2-csa-reserved", "tp1-dcp2-hca-reserved", "tp1-dcp2-csa-fp8", "tp1-dcp2-hca-fp8"]
MEMORY_CASES = ["tp1-dcp2-csa-memory", "tp1-dcp2-hca-memory", "dcp-interleave2-csa-memory",
                "dcp-interleave2-hca-memory"]
ALL = TP_CASES + DCP_CASES + MEMORY_CASES
#: Wall-clock bound of one group of processes (they take ~15 s on a loaded 2-core machine).
TIMEOUT_S = 240
#: NVLink multicast off on the GPU machine (see the issue): NCCL, PyTorch symmetric memory, NVSHMEM.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _spawn(tmp_path_factory, backend: str, dtypes: tuple[str, ...]) -> dict:
    d = tmp_path_factory.mktemp(f"dist_{backend}")
    out = d / "results.pt"
    ctx = mp.spawn(spawn_worker, args=(2, f"file://{d / 'store'}", backend, str(out), dtypes), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):  # raises if a process failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {backend} processes did not finish in {TIMEOUT_S} s (a collective hung?)")
    return torch.load(out)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return _spawn(tmp_path_factory, "gloo", ("float32",))


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    """fp32 and bf16 in one pair of processes (one CUDA start-up and Triton compile)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    return _spawn(tmp_path_factory, "nccl", ("float32", "bfloat16"))


def _check(results: dict, case: str) -> None:
    r = results[case]
    assert r["err"] <= r["tol"], f"{case}: max rel err {r['err']:.3e} > tol {r['tol']:.1e} ({r})"
    assert r["ok"], r
    if case.endswith("memory"):
        for rank_bytes in r["rank_bytes"]:
            for cache, single in r["single_bytes"].items():
                assert 0 < rank_bytes[cache] < single, (cache, r)
        assert r["mem_ok"], r


@pytest.mark.parametrize("case", ALL)
def test_gloo_two_processes_equal_one(gloo_results, case):
    _check(gloo_results, case)


def test_gloo_covers_every_case(gloo_results):
    assert sorted(gloo_results) == sorted(ALL)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALL)
def test_nccl_two_gpus_equal_one(nccl_results, case):
    _check(nccl_results, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALL)
def test_nccl_two_gpus_bf16_within_twice_single_error(nccl_results, case):
    _check(nccl_results, f"{case}-bfloat16")


def test_torchrun_tp2_x_dcp2_check():
    """The launcher end to end: torchrun, env:// rendezvous, TP and DCP groups of a 2 x 2 world."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "dsv4attn.distributed", "--tp", "2", "--dcp", "2", "--check", "--device", "cpu",
           "--kinds", "sliding,csa"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session it leads
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{stdout[-2000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("  tp2-dcp2-")]
    assert len(lines) == 3 and all(" ok" in ln for ln in lines), stdout  # sliding, csa, csa-memory
