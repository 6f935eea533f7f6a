import threading
import time

import numpy as np
import pytest
import torch

from trellis.loader.prefetch import Prefetcher, prefetch_iter
from trellis.loader.sampler import NeighborLoader, NeighborSampler

from .conftest import random_csr


def _threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("trellis-prefetch")}


@pytest.mark.parametrize("depth,workers", [(0, 1), (1, 1), (3, 1), (2, 3)])
def test_prefetched_batches_equal_sequential(depth, workers):
    indptr, indices = random_csr(n=500, seed=2)
    x = np.random.default_rng(0).standard_normal((500, 4)).astype(np.float32)
    y = np.arange(500) % 5
    s = NeighborSampler(indptr, indices, [4, 3])
    ref_loader = NeighborLoader(s, np.arange(500), 37, x=x, y=y, seed=3, prefetch=0)
    ref = [(b.node_ids.clone(), [blk.indices.clone() for blk in b.blocks], b.x.clone(), b.y.clone())
           for b in ref_loader.epoch(4)]
    ld = NeighborLoader(s, np.arange(500), 37, x=x, y=y, seed=3, prefetch=depth, workers=workers)
    got = []
    for b in ld.epoch(4):
        time.sleep(0.001)  # let workers run ahead into the rotating buffers
        got.append((b.node_ids.clone(), [blk.indices.clone() for blk in b.blocks], b.x.clone(), b.y.clone()))
    assert len(got) == len(ref)
    for (a_ids, a_ix, a_x, a_y), (b_ids, b_ix, b_x, b_y) in zip(ref, got):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_x, b_x) and torch.equal(a_y, b_y)
        assert all(torch.equal(p, q) for p, q in zip(a_ix, b_ix))
    assert not _threads()


def test_prefetcher_order_bounded_and_exceptions():
    started = []
    lock = threading.Lock()

    def make(i):
        with lock:
            started.append(i)
        if i == 5:
            raise RuntimeError("boom at 5")
        return i * i

    p = Prefetcher(make, 10, depth=2)
    assert next(p) == 0
    time.sleep(0.05)
    assert max(started) <= 2  # bounded: consumer took 0, at most items 1..2 in flight
    assert [next(p) for _ in range(4)] == [1, 4, 9, 16]
    with pytest.raises(RuntimeError, match="boom at 5"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    assert not _threads()


def test_prefetcher_early_exit_shuts_down():
    p = Prefetcher(lambda i: time.sleep(0.01) or i, 100, depth=4, workers=2)
    for i in p:
        if i == 3:
            break
    p.close()
    assert not _threads()
    with Prefetcher(lambda i: i, 5, depth=2) as q:
        assert list(q) == [0, 1, 2, 3, 4]
    assert not _threads()


def test_prefetch_iter():
    assert list(prefetch_iter(iter(range(20)), depth=3)) == list(range(20))
    assert list(prefetch_iter(range(5), depth=0)) == list(range(5))

    def gen():
        yield 1
        raise ValueError("bad")

    it = prefetch_iter(gen(), depth=2)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad"):
        next(it)
    it = prefetch_iter(iter(range(1000)), depth=2)
    assert next(it) == 0
    it.close()
    assert not _threads()
