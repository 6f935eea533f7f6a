#!/usr/bin/env bash
# Every device check of a 15-minute device session in one prepared command (what session 43 ran in two calls).
#
#   bash benchmarks/device_session.sh          # on the device, in the repository root; $OUT (or ./gpu-out) gets the logs
#
# Carry the pymetis wheel (the image lacks it; docs/benchmarks.md "Fifth GPU run"): here, once,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl pymetis          (.whl is git-excluded)
# and name ".whl" in the device call's carry. About 7 minutes in all on an H200 with 16 cores:
# 1. `gpu.sh` (20k nodes, no PyG table) while the 1M graph of `gpu_scaling.sh` and the 2M out-of-core store build;
# 2. the sampler-process tables, trainer on the GPU and on the CPU (`gpu_scaling.sh`, T2 = T4 = 0);
# 3. the out-of-core sweep of 4 configurations against 4 solo runs on 16 cores (issue #24, part 4).
# Each step has its own timeout so one slow step leaves the others.
set -uo pipefail
O=${OUT:-gpu-out}; mkdir -p "$O"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
s=$SECONDS
nproc; python3 -c 'import torch, numba; print("torch", torch.__version__, "numba", numba.__version__)'
( PREP=1 DATA=/tmp/d1m bash benchmarks/gpu_scaling.sh "$O" > "$O/prep.txt" 2>&1 ) &
( python3 -c "
from pathlib import Path
from benchmarks.bench_outofcore import StoreSpec, store_for, parse_count
d = Path('/tmp/trellis-bench-ooc'); d.mkdir(parents=True, exist_ok=True)
print(store_for(d, StoreSpec(parse_count('2m'), 10.0, 128)))" > "$O/prep2m.txt" 2>&1 ) &
NODES=20000 BENCH=0 timeout 200 bash benchmarks/gpu.sh "$O" > "$O/gpu.txt" 2>&1
echo "gpu.sh rc=$? at $((SECONDS - s)) s"; wait; echo "data ready at $((SECONDS - s)) s"
DATA=/tmp/d1m T1=95 T2=0 T3=85 T4=0 bash benchmarks/gpu_scaling.sh "$O" > "$O/scaling.txt" 2>&1
echo "samplers tables at $((SECONDS - s)) s"; grep -v '^{' "$O/scaling.txt"
timeout 200 python3 -m benchmarks.bench_outofcore_sweep --nodes 2m --epochs 3 --budget 3G \
  --grid lr=0.01,0.005 weight_decay=0,5e-4 --set dropout=0.5 > "$O/ooc_sweep.txt" 2>&1
echo "out-of-core sweep rc=$? at $((SECONDS - s)) s"; tail -8 "$O/ooc_sweep.txt"
echo "== gpu.sh"; cat "$O/gpu.txt"
