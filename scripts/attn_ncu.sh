#!/usr/bin/env bash
# Nsight Compute stall profile of the default fp8 decode attention kernel, one launch, by source line
# (docs/benchmarks.md, Table 48):  bash scripts/attn_ncu.sh HEADS BATCH TAG [CONFIG]   (on the GPU machine; logs
# to $OUT; CONFIG: KernelConfig fields to change, as scripts/attn_profile.py --config takes them;
# PROFILE_ARGS: more arguments of scripts/attn_profile.py, e.g. "--prefill 2048" with BATCH query tokens)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
H=$1; B=$2; TAG=$3
export TRITON_CACHE_DIR=/tmp/tc_$TAG
rm -rf $TRITON_CACHE_DIR
NV=$(python3 -c "import triton,os;print(os.path.dirname(triton.__file__)+'/backends/nvidia/bin')")
timeout 240 ncu -k regex:sparse_mla_attn --launch-skip 2 -c 1 --section WarpStateStats --section SourceCounters \
  --clock-control none -f -o /tmp/prof_$TAG python3 -m scripts.attn_profile --heads $H --batch $B --config "${4:-}" ${PROFILE_ARGS:-} > $OUT/ncu_$TAG.log 2>&1
ncu -i /tmp/prof_$TAG.ncu-rep --page source --print-source sass --csv > /tmp/src_$TAG.csv 2>/dev/null
ncu -i /tmp/prof_$TAG.ncu-rep --page details --section WarpStateStats >> $OUT/ncu_$TAG.log 2>&1
CUBIN=$(find $TRITON_CACHE_DIR -name "_sparse_mla_attn_sm90_*kernel.cubin" | head -1)  # the one kernel launched
$NV/nvdisasm -g -c $CUBIN > /tmp/k_$TAG.sass
python3 -m scripts.ncu_top /tmp/src_$TAG.csv 45 --sass /tmp/k_$TAG.sass > $OUT/top_$TAG.txt 2>&1
python3 -m scripts.ncu_top /tmp/src_$TAG.csv 30 >> $OUT/top_$TAG.txt 2>&1
