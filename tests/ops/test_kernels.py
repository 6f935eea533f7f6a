import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.ops.strategies import random_graph
from trellis.ops import WITH_NUMBA, kernels, spmm, use_numba


def test_disable_env_forces_torch_path():
    code = "import trellis.ops as o; print(o.WITH_NUMBA)"
    env = {**os.environ, "TRELLIS_DISABLE_NUMBA": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(not WITH_NUMBA, reason="numba not installed")
def test_use_numba_switch_and_dispatch_rules():
    x = torch.randn(3, 2)
    assert kernels.wants_numba(x) and not kernels.wants_numba(x.half())
    with use_numba(False):
        assert not kernels.enabled() and not kernels.wants_numba(x)
    assert kernels.enabled()


@pytest.mark.parametrize("power", [0.0, 1.5])
def test_row_chunks_cover_rows_and_balance_edges(power):
    g = random_graph(1000, 1000, 20000, seed=0, power=power)
    b = kernels.row_chunks(g)
    assert b[0] == 0 and b[-1] == 1000 and np.all(np.diff(b) >= 0)
    indptr = g.indptr.numpy()
    cost = np.diff(indptr[b] + b)
    assert cost.max() <= (20000 + 1000) / kernels.NUM_CHUNKS + indptr[1:].__sub__(indptr[:-1]).max() + 1


def test_empty_graph_and_empty_features():
    g = random_graph(5, 5, 0)
    for flag in (True, False):
        with use_numba(flag):
            assert torch.equal(spmm(g, torch.randn(5, 3)), torch.zeros(5, 3))
            assert spmm(g, torch.randn(5, 0), reduce="max").shape == (5, 0)


def _child_spmm(queue):
    g = random_graph(2000, 2000, 40000, seed=1)
    x = torch.ones(2000, 8)
    queue.put(float(spmm(g, x).sum()))


@pytest.mark.skipif(not WITH_NUMBA, reason="numba not installed")
def test_parallel_kernels_work_after_fork_and_from_threads():
    import multiprocessing as mp
    from concurrent.futures import ThreadPoolExecutor

    g = random_graph(2000, 2000, 40000, seed=1)
    x = torch.ones(2000, 8)
    expected = float(spmm(g, x).sum())  # starts the pool in this process
    assert expected == 40000 * 8
    with ThreadPoolExecutor(3) as ex:  # concurrent callers share the pool
        assert all(float(s) == expected for s in ex.map(lambda _: spmm(g, x).sum(), range(6)))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_spmm, args=(queue,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0 and queue.get(timeout=5) == expected
