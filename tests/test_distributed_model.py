"""A whole model over two processes: TP 2 and DCP 2 generate the same tokens as one process.

Oracle: the single-process ``PagedDeepseekV4.generate`` (itself equal to transformers' greedy
``generate`` token for token in fp32, test_serving_model.py) on the same tiny model (layers
sliding / CSA r=4 / HCA r=128, seed 0). In fp32 the parallel paths only reorder sums (~1e-6
relative, test_distributed_layers.py), far below the random model's logit gaps, so the greedy
tokens must be identical. Prompts of 6, 125 and 131 tokens with 8 new tokens cross the 4- and
128-boundaries in prefill chunks (token budget 64, chunks of 40) and in decode (125 + 8 > 128);
requests join while others decode.

One pair of spawned processes (gloo on CPU; NCCL on two GPUs for the ``gpu`` variant) runs: the
model API with TP 2, DCP 2 (interleave 1) and DCP 2 (interleave 2), then the command line
in-process (``dsv4attn.serving.cli.main`` with ``--tp 2`` / ``--dcp 2 --check``, the world
already joined), and a DCP step only rank 0 is too short for (raised on both ranks, nothing
changed); rank 0 saves what every rank saw. The ``slow`` test starts the same command
lines under torchrun.

GPU command (two GPUs): ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1 python3 -m pytest -q -m gpu tests/test_distributed_model.py``.
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

LENGTHS = (6, 125, 131)
NEW = 8
KW = dict(max_model_len=256, max_num_batched_tokens=128, max_num_reqs=2)  # 2 live: the third joins later
GEN = dict(token_budget=64, chunk_size=40)
TIMEOUT_S = 300
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CASES = ("tp2", "dcp2", "dcp2-interleave2")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _cli_args(prompts_file: str, device: str) -> list[str]:
    return ["generate", "--tiny", "0", "--prompts", prompts_file, "--max-new-tokens", str(NEW), "--json",
            "--no-progress", "--device", device, "--dtype", "float32"]


def _run_cli(argv: list[str]) -> tuple[int, list]:
    from dsv4attn.serving.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    lines = buf.getvalue().strip().splitlines()
    return rc, (json.loads(lines[-1]) if lines else None)


def worker(rank: int, world: int, init_method: str, backend: str, out_path: str, prompts_file: str) -> None:
    """One rank: the model API under each split, then the CLI in-process; rank 0 saves the results."""
    import torch.distributed as dist

    from dsv4attn.distributed.launch import ParallelConfig, ParallelContext, init_parallel
    from dsv4attn.distributed.model import ParallelPagedDeepseekV4
    from dsv4attn.serving.tiny import tiny_hf_model

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    tp = init_parallel(ParallelConfig(tp=world), rank=rank, world_size=world, local_rank=rank,
                       init_method=init_method, backend=backend, device=device)
    w = dist.group.WORLD
    ctxs = {"tp2": tp}
    for name, inter in (("dcp2", 1), ("dcp2-interleave2", 2)):
        ctxs[name] = ParallelContext(ParallelConfig(dcp=world, dcp_interleave=inter), rank, world, device, 0, rank,
                                     None, w)
    impl = "auto" if backend == "nccl" else "reference"
    res = {}
    model = tiny_hf_model(0, device=device)
    for name, ctx in ctxs.items():
        pm = ParallelPagedDeepseekV4(model, ctx, impl=impl, **KW)
        out = pm.generate(_prompts(), NEW, **GEN)
        full = pm.engine.num_blocks.get("full_mla")
        res[name] = dict(tokens=out, live=pm.requests, free=pm.engine.num_free_blocks(), pool=full,
                         heads=pm.layers[0].num_heads)
    res["refusal"] = _refusal(model, rank, world, device, impl)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dev = "cuda" if backend == "nccl" else "cpu"
    res["cli-tp2"] = _run_cli(_cli_args(prompts_file, dev) + ["--tp", "2"])
    res["cli-dcp2"] = _run_cli(_cli_args(prompts_file, dev) + ["--dcp", "2", "--check"])
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        torch.save(every, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _refusal(model, rank: int, world: int, device, impl: str) -> dict:
    """DCP 2 with 2 main blocks per rank: 1028 tokens (257 C4A entries) need 3 columns on rank 0
    (129 local entries) and 2 on rank 1 (128), so only rank 0 is short; both must raise. Also an
    interleave that does not divide the C128A block (2 entries) is refused."""
    import torch.distributed as dist

    from dsv4attn.distributed.launch import ParallelConfig, ParallelContext
    from dsv4attn.distributed.model import ParallelPagedDeepseekV4
    from dsv4attn.kv_cache.allocator import PoolExhaustedError

    def ctx(inter):
        return ParallelContext(ParallelConfig(dcp=world, dcp_interleave=inter), rank, world, device, 0, rank, None,
                               dist.group.WORLD)

    try:
        ParallelPagedDeepseekV4(model, ctx(3), impl=impl, max_model_len=256)
        bad_interleave = None
    except ValueError as e:
        bad_interleave = str(e)
    pm = ParallelPagedDeepseekV4(model, ctx(1), impl=impl, num_blocks=2, max_model_len=2048,
                                 max_num_batched_tokens=2048, max_num_reqs=2)
    eng = pm.engine
    need = eng.manager.blocks_needed_by_group(None, 1028)["full_mla"]  # this rank's own count
    try:
        eng.begin_step({"a": 1028})
        raised = None
    except PoolExhaustedError as e:
        raised = str(e)
    unchanged = eng.requests == [] and eng.num_free_blocks() == 2 and not eng.in_step
    eng.begin_step({"a": 600})  # fits everywhere: the engine still works
    ok_after = eng.requests == ["a"]
    eng.abort_step()
    return dict(need=need, raised=raised, unchanged=unchanged, ok_after=ok_after and eng.requests == [],
                reserve=eng.blocks_to_reserve(1028), bad_interleave=bad_interleave)


def _spawn(tmp_path_factory, backend: str) -> dict:
    from dsv4attn.serving.model import PagedDeepseekV4
    from dsv4attn.serving.tiny import tiny_hf_model

    d = tmp_path_factory.mktemp(f"model_{backend}")
    pfile = d / "prompts.json"
    pfile.write_text(json.dumps(_prompts()))
    out = d / "results.pt"
    ctx = mp.spawn(worker, args=(2, f"file://{d / 'store'}", backend, str(out), str(pfile)), nprocs=2, join=False)
    # the single process meanwhile (one thread: the 2 cores are the workers'): the model API and the CLI
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = PagedDeepseekV4(tiny_hf_model(0), impl="reference", **KW).generate(_prompts(), NEW, **GEN)
        cli_single = _run_cli(_cli_args(str(pfile), "cpu"))
    finally:
        torch.set_num_threads(threads)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):  # raises if a process failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {backend} processes did not finish in {TIMEOUT_S} s (a collective hung?)")
    return dict(ranks=torch.load(out), single=single, cli_single=cli_single, prompts_file=str(pfile))


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    return _spawn(tmp_path_factory, "gloo")


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    return _spawn(tmp_path_factory, "nccl")


def _check_generate(r: dict, case: str) -> None:
    assert len(r["single"]) == len(LENGTHS) and all(len(o) == NEW for o in r["single"])
    for rank, res in enumerate(r["ranks"]):
        got = res[case]
        assert got["tokens"] == r["single"], (case, rank)
        assert got["live"] == [] and got["free"] == got["pool"], (case, rank, got)  # every block back
        assert got["heads"] == (2 if case == "tp2" else 4)  # the tiny model's 4 heads, split by TP


def _check_cli(r: dict, case: str) -> None:
    rc, want = r["cli_single"]
    assert rc == 0 and len(want) == len(LENGTHS)
    rc0, got = r["ranks"][0][case]
    assert rc0 == 0 and got == want, case  # rank 0 prints the tokens (and the check's PASS)
    for res in r["ranks"][1:]:
        assert res[case] == (0, None), case  # the other ranks print nothing


@pytest.mark.parametrize("case", CASES)
def test_gloo_generate_equals_one_process(gloo, case):
    _check_generate(gloo, case)


@pytest.mark.parametrize("case", ["cli-tp2", "cli-dcp2"])
def test_gloo_cli_equals_one_process(gloo, case):
    _check_cli(gloo, case)


def _check_refusal(r: dict) -> None:
    r0, r1 = (res["refusal"] for res in r["ranks"])
    assert (r0["need"], r1["need"]) == (3, 2)  # only rank 0 is short of its 2 blocks
    assert "'full_mla', only 2 of 2 free" in r0["raised"] and "another DCP rank" in r1["raised"]
    for r in (r0, r1):
        assert r["unchanged"] and r["ok_after"], r
        assert r["reserve"] == 3  # rank 0's count on every rank: schedulers admit alike
        assert "interleave=3 must divide" in r["bad_interleave"], r


def test_gloo_shortfall_on_one_rank_raises_on_every_rank(gloo):
    _check_refusal(gloo)


@pytest.mark.gpu
def test_nccl_shortfall_on_one_rank_raises_on_every_rank(nccl):
    _check_refusal(nccl)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_nccl_generate_equals_one_process(nccl, case):
    _check_generate(nccl, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["cli-tp2", "cli-dcp2"])
def test_nccl_cli_equals_one_process(nccl, case):
    _check_cli(nccl, case)


def _torchrun(args: list[str], nproc: int) -> tuple[int, str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **NO_MULTICAST)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "dsv4attn", *args]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session it leads
        stdout, stderr = proc.communicate()
    return proc.returncode, stdout, stderr


@pytest.mark.slow
def test_torchrun_generate_tp2_and_dcp2_equal_one_process(tmp_path):
    """The real launcher: torchrun's env:// rendezvous, two workers, rank 0's --json line."""
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(_prompts()))
    rc, want = _run_cli(_cli_args(str(pfile), "cpu"))
    assert rc == 0
    for flag in ("--tp", "--dcp"):
        rc, out, err = _torchrun(_cli_args(str(pfile), "cpu") + [flag, "2"], 2)
        assert rc == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == want, (flag, out)
        assert out.count("workload:") == 1, out  # only rank 0 prints
