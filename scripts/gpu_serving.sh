#!/usr/bin/env bash
# One device call (<= 600 s on the H200) for the serving work (issue "Serve a whole model"):
#   bash scripts/gpu_serving.sh [steps...]     steps: graphs kernels profile bench generate prefix
#                                               (default: graphs kernels profile bench)
# graphs:  the GPU tests of the CUDA-graph and speculative paths, alone on the GPU (their
#          bit-for-bit replay tests take ~90 s each and time out when other tests share the GPU;
#          the seven took 263 s on the H200 on 2026-12-04, with their compiles);
# kernels: the serving kernels' and the layer path's tests on compiled kernels;
# profile: kernels per replayed layer step (scripts/step_profile.py);
# bench:   benchmarks.bench_model decode (eager + graph replay) and prefill;
# generate: bench_model's generate-throughput table (long; run it in a call of its own);
# prefix:  the GPU tests of prefix caching (captured graphs with a request started from a hold)
#          and of the warm-up (no compile while serving), then benchmarks.bench_prefix.
# Logs go to $OUT (device tool) or ./out.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"
steps=${*:-graphs kernels profile bench}
xd=""; python3 -c "import xdist" 2>/dev/null && xd="-n 7"
for step in $steps; do
  case $step in
    graphs) timeout 400 python3 -m pytest -q $xd -p no:cacheprovider -m gpu tests/test_serving_graphs.py \
              tests/test_spec_graphs.py tests/test_layer_runner.py 2>&1 | tail -n 20 > "$out/graphs.txt"
            tail -n 3 "$out/graphs.txt" ;;
    kernels) timeout 150 python3 -m pytest -q $xd -p no:cacheprovider tests/test_norm_rope.py tests/test_kv_writers.py \
               tests/test_layer_precision.py tests/test_compressor_ops.py tests/test_indexer_ops.py 2>&1 | tail -n 20 \
               > "$out/kernels.txt"; tail -n 3 "$out/kernels.txt" ;;
    profile) timeout 60 python3 -m scripts.step_profile --batch 64 --ctx 4096 --top 40 > "$out/profile.txt" 2>&1
             grep "^L" "$out/profile.txt" ;;
    bench) timeout 200 python3 -m benchmarks.bench_model --skip generate > "$out/bench_model.txt" 2>&1
           grep "graph\|prefill" "$out/bench_model.txt" ;;
    generate) timeout 500 python3 -m benchmarks.bench_model --skip decode,prefill > "$out/generate.txt" 2>&1
              tail -n 5 "$out/generate.txt" ;;
    prefix) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_prefix_cache.py tests/test_warmup.py \
              2>&1 | tail -n 20 > "$out/prefix.txt"; tail -n 3 "$out/prefix.txt"
            timeout 150 python3 -m benchmarks.bench_prefix > "$out/bench_prefix.txt" 2>&1; grep "^|" "$out/bench_prefix.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
