#!/usr/bin/env bash
# Every device check of a 15-minute device session in one prepared command (what session 43 ran in two calls).
#
#   bash benchmarks/device_session.sh          # on the device, in the repository root; $OUT (or ./gpu-out) gets the logs
#
# Carry the pymetis wheel (the image lacks it; docs/benchmarks.md "Fifth GPU run"): here, once,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl pymetis          (.whl is git-excluded)
# and name ".whl" in the device call's carry. About 8 minutes in all on an H200 with 16 cores:
# 1. the machine (CPU model, the kernel's transparent-huge-page settings);
# 2. `gpu.sh` (20k nodes, no PyG table) while the 1M graph of `gpu_scaling.sh` builds (about 300 s);
# 3. the sampler-process table with the trainer on the GPU: the rows on the host (the default), the rows on the
#    GPU (`--feature-residency device`: the samplers only sample, the trainer gathers), and the host rows again at
#    THP_MEM_ALLOC_ENABLE=0: the sixth run's samplers built batches at half the fifth run's rate (docs/benchmarks.md
#    "Sixth GPU run"), and huge pages are the one change since that touches every process.
# The CPU-trainer table and the out-of-core sweep were measured in the sixth run (T1=110 and
# `python -m benchmarks.bench_outofcore_sweep --nodes 2m ...` rerun them). Each step has its own timeout.
set -uo pipefail
O=${OUT:-gpu-out}; mkdir -p "$O"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
s=$SECONDS
nproc; python3 -c 'import torch, numba; print("torch", torch.__version__, "numba", numba.__version__)'
lscpu | grep -iE "model name|^cpu\(s\)|thread\(s\) per core|mhz" ; uname -r
for f in enabled defrag shmem_enabled; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>/dev/null)"; done
( PREP=1 DATA=/tmp/d1m bash benchmarks/gpu_scaling.sh "$O" > "$O/prep.txt" 2>&1 ) &
NODES=20000 BENCH=0 timeout 300 bash benchmarks/gpu.sh "$O" > "$O/gpu.txt" 2>&1
echo "gpu.sh rc=$? at $((SECONDS - s)) s"; wait; echo "data ready at $((SECONDS - s)) s"
for run in host device host,0; do
  res=${run%%,*}; thp=${run#"$res"}; thp=${thp#,}
  env ${thp:+THP_MEM_ALLOC_ENABLE=$thp} RES=$res DATA=/tmp/d1m T1=0 T2=0 T3=75 T4=0 KS=0,1,4,8 \
    bash benchmarks/gpu_scaling.sh "$O" > "$O/scaling_$res${thp:+_thp$thp}.txt" 2>&1
  echo "samplers table (rows on $res, THP_MEM_ALLOC_ENABLE=${thp:-default}) at $((SECONDS - s)) s"
  grep -v '^{' "$O/scaling_$res${thp:+_thp$thp}.txt" | grep -v "fresh buffers:"
done
echo "== gpu.sh"; cat "$O/gpu.txt"
