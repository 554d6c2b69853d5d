#!/usr/bin/env bash
# One device call: environment facts, the whole test suite on the GPU (compiled Triton kernels),
# then every benchmark. Logs go to $OUT (device tool) or ./out.
#   bash scripts/gpu_check.sh [tests|bench|all] [pytest args...]
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-out}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.log"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import transformers; print("transformers", transformers.__version__)
except Exception as e:
    print("transformers missing", e)
PY
echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" | tee -a "$out/env.log"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -rs --durations=15 tests "$@" 2>&1 | tee "$out/pytest.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in benchmarks/bench_*.py; do
    m=$(basename "$b" .py)
    echo "=== $m"
    timeout 240 python3 -m "benchmarks.$m" "$@" 2>&1 | tee "$out/$m.log"
  done
fi
exit $rc
