#!/usr/bin/env bash
# Build the separate DGL environment the mini-batch benchmark compares against (never used by CI or tests).
# DGL 2.1 does not import with torch 2.13, so it gets its own venv with torch 2.2.1 (the PyPI wheel, which
# needs the CUDA runtime wheels to import even on a CPU-only machine; about 3 GB).
#   bash benchmarks/make_dgl_env.sh [VENV_DIR]     (default: /tmp/dglenv)
set -euo pipefail
VENV="${1:-/tmp/dglenv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==2.2.1" "numpy<2"
"$VENV/bin/pip" install -q --no-deps "dgl==2.1.0" "pandas<2.3" "torchdata==0.7.1"
"$VENV/bin/pip" install -q scipy tqdm psutil requests pydantic networkx packaging pyyaml urllib3 python-dateutil pytz tzdata
"$VENV/bin/python" -c "import dgl, torch; print('dgl', dgl.__version__, 'torch', torch.__version__)"
echo "run: TRELLIS_DGL_PYTHON=$VENV/bin/python python -m benchmarks.bench_minibatch"
