"""The batch-source contract: neighbour, cluster and pre-propagated batches by ``plan(seed)`` / ``get(plan, i)``."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch

from trellis.loader.blocks import Batch
from trellis.loader.cluster import ClusterLoader, hash_clusters
from trellis.loader.pp import MemorySource, PPLoader, RowBatch, StorageSource
from trellis.loader.ppcache import PPSettings, ensure_pp
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.loader.source import BatchSource, EpochPlan, iter_epoch
from trellis.ops.propagate import OperatorSpec

from .conftest import random_csr
from .test_pp import make_store

N = 400


def snapshot(batch: Batch | RowBatch) -> list[torch.Tensor | None]:
    """Every tensor of a batch, cloned (loaders reuse their buffers)."""
    if isinstance(batch, RowBatch):
        return [batch.x.clone(), None if batch.y is None else batch.y.clone()]
    out: list[torch.Tensor | None] = [batch.node_ids.clone(), batch.x.clone(), batch.y.clone()]
    out.append(None if batch.loss_mask is None else batch.loss_mask.clone())
    for b in batch.blocks:
        out += [b.indptr.clone(), b.indices.clone()]
    return out


def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all((p is None and q is None) or (p is not None and q is not None and torch.equal(p, q))
                                    for p, q in zip(a, b))


@pytest.fixture(scope="module")
def graph():
    indptr, indices = random_csr(n=N, seed=7)
    x = np.random.default_rng(1).standard_normal((N, 5)).astype(np.float32)
    y = np.arange(N) % 4
    return indptr, indices, x, y


@pytest.fixture(scope="module")
def pp_cache(tmp_path_factory):
    store = make_store(tmp_path_factory.mktemp("src") / "store")
    c, _ = ensure_pp(store, tmp_path_factory.mktemp("srcpp") / "pp", PPSettings(OperatorSpec("sym"), hops=2),
                     progress=False, log=None)
    return c


def neighbor(graph, **kw) -> NeighborLoader:
    indptr, indices, x, y = graph
    return NeighborLoader(NeighborSampler(indptr, indices, [4, 3]), np.arange(0, N, 2), 29, x=x, y=y, seed=3, **kw)


def cluster(graph, **kw) -> ClusterLoader:
    indptr, indices, x, y = graph
    return ClusterLoader(indptr, indices, hash_clusters(N, 12, seed=1), 3, num_layers=2, boundary_hops=1, x=x, y=y,
                         loss_nodes=np.arange(0, N, 3), seed=5, **kw)


def pp(pp_cache, storage: bool = False, chunk: int = 1, prefetch: bool = False) -> PPLoader:
    rows = (0, 200)
    hops = (0, 1, 2)
    src = StorageSource(pp_cache, hops, rows, min_read_bytes=0) if storage else MemorySource(pp_cache, hops, rows)
    return PPLoader(src, 24, chunk_size=chunk, prefetch=storage or prefetch, seed=2, row_range=rows)


def epoch_of(src, seed: int) -> list[list[torch.Tensor | None]]:
    if isinstance(src, PPLoader):
        src.set_epoch(seed)
        return [snapshot(b) for b in src]
    return [snapshot(b) for b in src.epoch(seed)]


def sources(graph, pp_cache):
    return {"neighbor": neighbor(graph), "cluster": cluster(graph), "pp-memory": pp(pp_cache),
            "pp-chunk": pp(pp_cache, chunk=8), "pp-storage": pp(pp_cache, storage=True, chunk=4)}


@pytest.mark.parametrize("kind", ["neighbor", "cluster", "pp-memory", "pp-chunk", "pp-storage"])
def test_each_source_satisfies_the_protocol(graph, pp_cache, kind):
    src = sources(graph, pp_cache)[kind]
    assert isinstance(src, BatchSource)
    plan = src.plan(4)
    assert isinstance(plan, EpochPlan) and plan.epoch == 4
    assert len(plan) == len(src) > 1
    # get(plan, i) is the i-th batch of the epoch, built in any order
    ref = epoch_of(src, 4)
    assert len(ref) == len(src)
    for i in reversed(range(len(src))):
        assert same(snapshot(src.get(plan, i)), ref[i]), (kind, i)
    # the plan is deterministic in the seed, and another seed is another order
    assert same(snapshot(src.get(src.plan(4), 0)), ref[0])
    assert not all(same(a, b) for a, b in zip(ref, epoch_of(src, 5)))


@pytest.mark.parametrize("kind", ["neighbor", "cluster", "pp"])
def test_iter_epoch_with_workers_equals_sequential(graph, pp_cache, kind):
    ref_src, src = {"neighbor": (neighbor(graph, prefetch=0), neighbor(graph, prefetch=3, workers=3)),
                    "cluster": (cluster(graph, prefetch=0), cluster(graph, prefetch=3, workers=3)),
                    "pp": (pp(pp_cache), pp(pp_cache, prefetch=True))}[kind]
    ref = [snapshot(b) for b in iter_epoch(ref_src, 9)]
    got = []
    for b in iter_epoch(src, 9):  # the source's own prefetch depth and workers, which its buffers fit
        time.sleep(0.001)  # let the workers run ahead into the rotating buffers
        got.append(snapshot(b))
    assert len(got) == len(ref) and all(same(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("kind", ["neighbor", "cluster"])
def test_graph_sources_pickle_for_worker_processes(graph, pp_cache, kind):
    src = sources(graph, pp_cache)[kind]
    plan = src.plan(2)
    src.get(plan, 0)  # scratch maps and buffers exist before pickling
    clone = pickle.loads(pickle.dumps(src))
    for i in range(len(plan)):
        assert same(snapshot(clone.get(pickle.loads(pickle.dumps(plan)), i)), snapshot(src.get(plan, i)))
