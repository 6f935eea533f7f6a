import numpy as np
import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.loader.blocks import check_nested
from trellis.loader.cluster import ClusterLoader, hash_clusters, induced_subgraph

from .conftest import random_csr


def in_neighbors(indptr, indices, nodes):
    return set(np.concatenate([indices[indptr[v]:indptr[v + 1]] for v in nodes]).tolist()) if len(nodes) else set()


def global_edges(block, node_ids):
    ids = node_ids.numpy()
    dst = np.repeat(np.arange(block.num_dst), np.diff(block.indptr.numpy()))
    return set(zip(ids[dst].tolist(), ids[block.indices.numpy()].tolist()))


def induced_reference(indptr, indices, nodes):
    s = set(nodes.tolist())
    out = set()
    for v in s:
        for u in indices[indptr[v]:indptr[v + 1]]:
            if int(u) in s:
                out.add((v, int(u)))
    return out


@pytest.mark.parametrize("hops", [0, 1, 2])
def test_batches_are_induced_subgraphs_plus_boundary(hops):
    indptr, indices = random_csr(n=400, avg_deg=3, seed=1, hubs=False)
    parts = hash_clusters(400, 20, seed=0)
    x = np.random.default_rng(0).standard_normal((400, 3)).astype(np.float32)
    train = np.arange(0, 400, 3)
    ld = ClusterLoader(indptr, indices, parts, 4, num_layers=2, boundary_hops=hops, x=x, y=np.arange(400) % 7,
                       loss_nodes=train, prefetch=0)
    covered = []
    for b in ld.epoch(0):
        core = b.targets.numpy()
        covered.append(core)
        clusters = np.unique(parts[core])
        assert len(clusters) == 4 or len(covered) == len(ld)
        assert set(core.tolist()) == set(np.flatnonzero(np.isin(parts, clusters)).tolist())
        # hop layers: exactly the nodes within `hops` in-edge hops, nearest first
        ids = b.node_ids.numpy()
        assert len(np.unique(ids)) == len(ids)
        within = set(core.tolist())
        frontier = set(core.tolist())
        for _ in range(hops):
            frontier = in_neighbors(indptr, indices, sorted(frontier)) - within
            within |= frontier
        assert set(ids.tolist()) == within
        # the square graph is the induced subgraph on all of them
        full = b.blocks[0] if hops == 0 else None
        if hops == 0:
            assert b.graph is full
            assert global_edges(full, b.node_ids) == induced_reference(indptr, indices, core)
        else:
            check_nested(b.blocks)
            assert b.blocks[-1].num_dst == len(core)
            assert b.blocks[0].num_src == len(ids)
            ref = induced_reference(indptr, indices, ids)
            for blk in b.blocks:
                rows = set(ids[: blk.num_dst].tolist())
                assert global_edges(blk, b.node_ids) == {e for e in ref if e[0] in rows}
                assert blk.indices.max().item() < blk.num_src if blk.num_edges else True
        assert np.array_equal(b.x.numpy(), x[ids])
        assert torch.equal(b.loss_mask, torch.from_numpy(np.isin(core, train)))
        assert np.array_equal(b.y.numpy(), core % 7)
    allc = np.concatenate(covered)
    assert np.array_equal(np.sort(allc), np.arange(400))  # every node a target exactly once per epoch


def test_epochs_shuffle_reproducibly():
    indptr, indices = random_csr(n=200, seed=4)
    parts = hash_clusters(200, 10)
    ld = ClusterLoader(indptr, indices, parts, 3, num_layers=2, prefetch=1)
    a = [b.targets.clone() for b in ld.epoch(0)]
    b = [b.targets.clone() for b in ld.epoch(0)]
    c = [b.targets.clone() for b in ld.epoch(1)]
    assert len(a) == 4 and all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


@pytest.mark.parametrize("hops", [0, 2])
def test_workers_yield_identical_batches(hops):
    indptr, indices = random_csr(n=600, seed=6)
    x = np.random.default_rng(3).standard_normal((600, 6)).astype(np.float32)
    y = np.arange(600) % 7
    parts = hash_clusters(600, 20, seed=2)

    def epoch(workers, prefetch):
        ld = ClusterLoader(indptr, indices, parts, 3, num_layers=2, boundary_hops=hops, x=x, y=y,
                           loss_nodes=np.arange(0, 600, 2), seed=9, prefetch=prefetch, workers=workers)
        out = []
        for b in ld.epoch(1):
            out.append([b.node_ids.clone(), b.x.clone(), b.y.clone(), b.loss_mask.clone()]
                       + [t.clone() for blk in b.blocks for t in (blk.indptr, blk.indices)])
        return out

    one = epoch(1, 2)
    assert len(one) == 7
    for got in (epoch(3, 4), epoch(3, 1)):
        assert len(got) == len(one)
        assert all(len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b)) for a, b in zip(one, got))


def test_induced_subgraph_resets_scratch():
    indptr, indices = random_csr(n=100, seed=0)
    scratch = np.full(100, -1, dtype=np.int32)
    induced_subgraph(indptr, indices, np.array([1, 5, 7]), boundary_hops=2, local_of=scratch)
    assert (scratch == -1).all()


def test_hash_clusters_balanced():
    p = hash_clusters(1003, 10, seed=2)
    sizes = np.bincount(p)
    assert sizes.max() - sizes.min() <= 1 and len(sizes) == 10


def test_bad_input():
    indptr, indices = random_csr(n=50, seed=0)
    parts = hash_clusters(50, 5)
    with pytest.raises(TrellisUserError, match="exceeds --clusters 5"):
        ClusterLoader(indptr, indices, parts, 6, num_layers=2)
    with pytest.raises(TrellisUserError, match="boundary-hops"):
        ClusterLoader(indptr, indices, parts, 2, num_layers=2, boundary_hops=3)
