"""Thread counts of torch and numba kernels (``trellis.utils.numba``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trellis.utils.numba import WITH_NUMBA

_SCRIPT = """
import numpy as np, torch
torch.set_num_threads(1)
torch.get_num_threads()  # torch has read its count on this thread
from trellis.utils.numba import get_num_threads, set_threads
set_threads(1)
from trellis.loader.features import gather_rows
src = np.ones((20_000, 64), dtype=np.float32)
gather_rows(src, np.arange(20_000, dtype=np.int64), np.empty_like(src))
print(torch.get_num_threads(), get_num_threads())
"""


@pytest.mark.skipif(not WITH_NUMBA, reason="numba's threading layer is what is tested")
def test_set_threads_survives_the_start_of_numbas_threading_layer():
    """In a fresh process (numba's layer starts once per process), with numba's pool larger than the count asked
    for: torch and numba both keep one thread after numba's layer started and ran a parallel kernel."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["1", "1"]
