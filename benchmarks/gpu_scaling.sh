#!/usr/bin/env bash
# Mini-batch scaling tables for a machine with many cores (and a GPU): what 2 cores cannot show.
#
#   bash benchmarks/gpu_scaling.sh [OUT_DIR]      # NODES=1000000 by default; DEV=cpu for a machine without a GPU
#
# On the 1M-node planted graph of docs/benchmarks.md (SBM, avg degree 10, 128 features, 16 classes, 5% train),
# GraphSAGE 15,10, batch 1024:
# 1. trainer throughput as sampler processes are added, trainer on the CPU (`--samplers K` leaves K cores to the
#    samplers), `python -m benchmarks.bench_samplers`;
# 2. data-parallel mini-batch on 2, 4 and 8 trainer ranks (8 GREM parts) against one process,
#    `python -m benchmarks.bench_dist_mini --ranks 2,4,8 --seeds 1 --epochs 2`;
# 3. the samplers table with the trainer on the GPU (Armada Fig. 8);
# 4. hybrid-parallel cluster-batch on 2 and 4 ranks against one process (GCN, 8 of 64 hash clusters),
#    `python -m benchmarks.bench_dist_cluster --ranks 2,4` (T4=0 skips it).
# Each step has its own timeout so one slow table leaves the others (T1..T4 seconds; 0 skips that step); KS picks
# the sampler counts of step 3, RES=device its --feature-residency (the rows on the GPU, gathered by the trainer).
# DATA=DIR keeps the graph and its layout in DIR and reuses them when they are there; PREP=1 only builds them
# (so a device call can build them while benchmarks/gpu.sh runs). CI never runs this.
set -uo pipefail
OUT=${1:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# the runtime dependencies (pyproject.toml) first: a device image may lack one (pymetis: carry its wheel)
$PY -c "import numpy, scipy, numba, tqdm, matplotlib, psutil, pymetis" || {
  echo "$0: a runtime dependency of trellis is missing here (above); install it first"; exit 2; }
T="$PY -m trellis.cli.main"
W=${DATA:-$(mktemp -d)}
mkdir -p "$W"
DEV=${DEV:-cuda}
nproc; $PY -c 'import torch; print("torch", torch.__version__, torch.get_num_threads(), "threads")'
s=$SECONDS
if [ ! -f "$W/ready" ]; then
  rm -rf "$W/g" "$W/p8"
  $T data generate sbm --nodes "${NODES:-1000000}" --avg-degree 10 --features 128 --classes 16 --seed 1 \
    --homophily 0.8 --train-frac 0.05 --val-frac 0.05 --out "$W/g" | tail -1
  $T partition "$W/g" --parts 8 --out "$W/p8" --json | tail -c 200; echo
  [ -d "$W/g" ] && [ -d "$W/p8" ] && touch "$W/ready"
  echo "data ready in $((SECONDS - s)) s"
fi
[ "${PREP:-0}" = 1 ] && exit 0
if [ "${T1:-110}" != 0 ]; then
  echo "== samplers, trainer on cpu"
  timeout "${T1:-110}" $PY -m benchmarks.bench_samplers --store "$W/g" --samplers 0,1,2,4 --device cpu --repeats 1 \
    2>&1 | tee "$OUT/samplers_cpu.txt"
fi
if [ "${T2:-220}" != 0 ]; then
  echo "== trainer ranks (cpu)"
  timeout "${T2:-220}" $PY -m benchmarks.bench_dist_mini --store "$W/g" --layout "$W/p8" --ranks 2,4,8 --seeds 1 \
    --epochs 2 2>&1 | tee "$OUT/ranks.txt"
fi
if [ "$DEV" != cpu ] && [ "${T3:-100}" != 0 ]; then
  echo "== samplers, trainer on $DEV (THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-default}, rows on ${RES:-host})"
  timeout "${T3:-100}" $PY -m benchmarks.bench_samplers --store "$W/g" --samplers "${KS:-0,1,2,4,8}" --device "$DEV" \
    --repeats 1 --feature-residency "${RES:-host}" \
    2>&1 | tee "$OUT/samplers_$DEV${THP_MEM_ALLOC_ENABLE:+_thp$THP_MEM_ALLOC_ENABLE}_${RES:-host}.txt"
fi
if [ "${T4:-150}" != 0 ]; then
  echo "== cluster-batch ranks (cpu)"
  timeout "${T4:-150}" $PY -m benchmarks.bench_dist_cluster --store "$W/g" --layout "$W/p8" --ranks 2,4 \
    --epochs 2 --cluster-method hash 2>&1 | tee "$OUT/cluster_ranks.txt"
fi
echo "total $((SECONDS - s)) s"
[ -n "${DATA:-}" ] || rm -rf "$W"
