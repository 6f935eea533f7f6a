#!/usr/bin/env bash
# CUDA checks and GPU benchmarks, for a machine with an NVIDIA GPU and a python3 whose torch has CUDA.
#
#   bash benchmarks/gpu.sh [OUT_DIR]
#
# 1. the CUDA tests (kernels on the GPU equal the CPU's, forward and gradients);
# 2. one `trellis train --device cuda` per strategy (full, mini, cluster, pp) and a model-batched sweep on a
#    generated graph, printing each summary line;
# 3. the full-batch step benchmark against PyG on the same GPU (benchmarks/bench_fullbatch.py --device cuda).
# CI never runs this (it has no GPU); the figures it printed are recorded in docs/benchmarks.md.
set -uo pipefail
OUT=${1:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T="$PY -m trellis.cli.main"
W=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

echo "== CUDA tests"
$PY -m pytest -q -p no:cacheprovider -W ignore tests/ops/test_spmm.py -k cuda 2>&1 | tail -2

echo "== one run per strategy on cuda"
$T data generate sbm --nodes 50000 --avg-degree 20 --features 128 --classes 8 --out "$W/g" --json >/dev/null
for args in "--model gcn --hidden 256" "--model gat" "--model sage --strategy mini" \
            "--model gcn --strategy cluster --clusters 16 --clusters-per-batch 4"; do
  echo "-- trellis train $args --device cuda"
  $T train "$W/g" $args --device cuda --epochs 30 --no-progress --out "$W/run-$RANDOM" 2>&1 | tail -3
done
$T preprocess "$W/g" --hops 3 --out "$W/pp" --no-progress | tail -1
echo "-- trellis train --strategy pp --model sign --device cuda"
$T train "$W/g" --strategy pp --pp-dir "$W/pp" --model sign --device cuda --epochs 30 --out "$W/run-pp" 2>&1 | tail -3
echo "-- trellis sweep (6 GCN configurations, model-batched) --device cuda"
$T sweep "$W/g" --model gcn --grid lr=0.01,0.005 hidden=64,128,256 --epochs 30 --device cuda --no-progress \
  --out "$W/sweep" 2>&1 | tail -4

if [ "${BENCH:-1}" = 1 ]; then
  echo "== full-batch step vs PyG on the GPU"
  $PY -m benchmarks.bench_fullbatch --device cuda --sizes "${SIZES:-100k,1m}" --repeat 10 2>&1 | tee "$OUT/fullbatch_cuda.txt"
fi
rm -rf "$W"
