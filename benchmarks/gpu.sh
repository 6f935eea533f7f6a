#!/usr/bin/env bash
# CUDA checks and GPU benchmarks, for a machine with an NVIDIA GPU and a python3 whose torch has CUDA.
#
#   bash benchmarks/gpu.sh [OUT_DIR]
#
# 1. the CUDA tests (kernels on the GPU equal the CPU's, forward and gradients; batches from sampler processes
#    moved to the GPU, from page-locked slots; every test with `cuda` in its name);
# 2. one `trellis train --device cuda` per strategy (full, mini, cluster, pp) and a model-batched sweep on a
#    generated graph, printing each summary line;
# 3. what landed since: mini/cluster through the partition buffer, --samplers (the rows on the host and on the GPU:
#    --feature-residency device), partition-parallel full-batch on
#    one rank (nccl) with --overlap --staleness, predict, tune, and the CPU-only --memory-budget refusal;
# 4. the full-batch step benchmark against PyG on the same GPU (benchmarks/bench_fullbatch.py --device cuda).
# DEV=cpu NODES=5000 BENCH=0 runs steps 2-3 on a machine without a GPU. CI never runs this (it has no GPU); the figures it printed are recorded in docs/benchmarks.md.
set -uo pipefail
OUT=${1:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# the runtime dependencies (pyproject.toml) first: a device image may lack one (pymetis: carry its wheel)
$PY -c "import numpy, scipy, numba, tqdm, matplotlib, psutil, pymetis" || {
  echo "$0: a runtime dependency of trellis is missing here (above); install it first"; exit 2; }
T="$PY -m trellis.cli.main"
W=$(mktemp -d)
DEV=${DEV:-cuda}  # DEV=cpu runs the same commands on a machine without a GPU
nvidia-smi 2>/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'

echo "== CUDA tests"
$PY -m pytest -q -p no:cacheprovider -W ignore -rs tests/ops/test_spmm.py tests/loader/test_producer.py -k cuda 2>&1 | tail -4

echo "== one run per strategy on $DEV"
$T data generate sbm --nodes ${NODES:-50000} --avg-degree 20 --features 128 --classes 8 --out "$W/g" --json >/dev/null
for args in "--model gcn --hidden 256" "--model gat" "--model sage --strategy mini" \
            "--model gcn --strategy cluster --clusters 16 --clusters-per-batch 4"; do
  echo "-- trellis train $args --device $DEV"
  $T train "$W/g" $args --device $DEV --epochs 30 --no-progress --out "$W/run-$RANDOM" 2>&1 | tail -3
done
$T preprocess "$W/g" --hops 3 --out "$W/pp" --no-progress | tail -1
echo "-- trellis train --strategy pp --model sign --device $DEV"
$T train "$W/g" --strategy pp --pp-dir "$W/pp" --model sign --device $DEV --epochs 30 --out "$W/run-pp" 2>&1 | tail -3
echo "-- trellis sweep (6 GCN configurations, model-batched) --device $DEV"
$T sweep "$W/g" --model gcn --grid lr=0.01,0.005 hidden=64,128,256 --epochs 30 --device $DEV --no-progress \
  --out "$W/sweep" 2>&1 | tail -4

echo "== since out-of-core and distributed training: buffer, ranks, sampler processes, predict, tune"
$T partition "$W/g" --parts 8 --out "$W/parts8" --json | tail -c 300; echo
$T partition "$W/g" --parts 1 --out "$W/parts1" --json >/dev/null
for args in "--model sage --strategy mini --parts-dir $W/parts8 --nproc 1 --buffer-parts 2" \
            "--model sage --strategy mini --parts-dir $W/parts8 --nproc 1 --buffer-parts 2 --buffer-replay 256" \
            "--model gcn --strategy cluster --parts-dir $W/parts8 --nproc 1 --buffer-parts 2" \
            "--model sage --strategy mini --samplers 2" \
            "--model sage --strategy mini --feature-residency device" \
            "--model sage --strategy mini --samplers 2 --feature-residency device" \
            "--model gcn --hidden 256 --parts-dir $W/parts1 --nproc 1" \
            "--model gcn --hidden 256 --parts-dir $W/parts1 --nproc 1 --overlap --staleness 1"; do
  echo "-- trellis train $args --device $DEV"
  $T train "$W/g" $args --device $DEV --epochs 10 --no-progress --out "$W/run-$RANDOM" 2>&1 | tail -3
done
echo "-- trellis train --memory-budget 2G --device $DEV (refused: the out-of-core engine is CPU-only)"
$T train "$W/g" --memory-budget 2G --device $DEV --epochs 2 --no-progress --out "$W/run-ooc" 2>&1 | tail -1
echo "-- trellis predict --device $DEV"
$T predict "$W/run-pp" "$W/g" --device $DEV --out "$W/pred.npy" --json 2>&1 | tail -1
echo "-- trellis tune --budget 45s --device $DEV"
$T tune "$W/g" --model gcn --budget 45s --device $DEV --no-progress --out "$W/tune" --json 2>&1 | tail -c 600; echo

if [ "${BENCH:-1}" = 1 ]; then
  echo "== full-batch step vs PyG on the GPU"
  $PY -m benchmarks.bench_fullbatch --device cuda --sizes "${SIZES:-100k,1m}" --repeat 10 2>&1 | tee "$OUT/fullbatch_cuda.txt"
fi
rm -rf "$W"
