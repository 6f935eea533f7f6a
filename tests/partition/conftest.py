"""Shared fixtures: small planted-partition and hand-made stores written with ``write_store``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from trellis.data.store import GraphStore, open_store, write_store


def planted_partition(n: int, k: int, deg_in: float, deg_out: float, seed: int = 0
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric planted-partition graph: ``k`` equal communities (shuffled ids), no self loops.

    Returns ``(indptr, indices, truth)`` of the in-edge CSR; ``truth[v]`` is v's community.
    """
    rng = np.random.default_rng(seed)
    truth = rng.permutation(np.arange(n) * k // n)
    members = np.argsort(truth, kind="stable")
    starts = np.searchsorted(truth[members], np.arange(k + 1))
    m_in, m_out = int(n * deg_in / 2), int(n * deg_out / 2)
    u = rng.integers(0, n, m_in)
    c = truth[u]
    v = members[starts[c] + (rng.random(m_in) * (starts[c + 1] - starts[c])).astype(np.int64)]
    src = np.concatenate([u, rng.integers(0, n, m_out)])
    dst = np.concatenate([v, rng.integers(0, n, m_out)])
    keep = src != dst
    a = sp.coo_matrix((np.ones(int(keep.sum())), (dst[keep], src[keep])), shape=(n, n)).tocsr()
    a = (a + a.T).tocsr()
    a.sum_duplicates()
    a.sort_indices()
    return a.indptr.astype(np.int64), a.indices.astype(np.int64), truth


def csr_from_edges(n: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSR (rows = destination, stable within a row) of an edge list, duplicates kept."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src[order]


def edge_dst(indptr: np.ndarray) -> np.ndarray:
    """Destination of every CSR edge."""
    indptr = np.asarray(indptr)
    return np.repeat(np.arange(indptr.shape[0] - 1, dtype=np.int64), np.diff(indptr))


def cut_frac(store: GraphStore, parts: np.ndarray) -> float:
    src = np.asarray(store.indices)
    dst = edge_dst(store.indptr)
    return float(np.mean(parts[src] != parts[dst])) if src.size else 0.0


@pytest.fixture(scope="session")
def planted_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[GraphStore, np.ndarray]:
    """4000 nodes, 4 strong communities (in-degree ~16 inside, ~0.5 across), with data on nodes and edges."""
    n = 4000
    indptr, indices, truth = planted_partition(n, 4, 16.0, 0.5, seed=7)
    rng = np.random.default_rng(1)
    e = indices.shape[0]
    path = tmp_path_factory.mktemp("planted") / "store"
    write_store(path, indptr=indptr, indices=indices, x=rng.random((n, 6)), y=truth,
                splits={"train": np.arange(0, n, 5), "val": np.arange(1, n, 5), "test": np.arange(2, n, 5)},
                edge_weight=rng.random(e), edge_feat=rng.random((e, 3)))
    return open_store(path), truth


@pytest.fixture(scope="session")
def planted16_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[GraphStore, np.ndarray]:
    """20000 nodes, 16 communities (in-degree ~10 inside, ~2 across): GREM vs METIS vs baselines."""
    indptr, indices, truth = planted_partition(20000, 16, 10.0, 2.0, seed=3)
    path = tmp_path_factory.mktemp("planted16") / "store"
    write_store(path, indptr=indptr, indices=indices)
    return open_store(path), truth


@pytest.fixture()
def make_store(tmp_path: Path):
    """Factory writing a small store from an edge list: ``make_store(n, src, dst, **arrays)``."""
    counter = iter(range(1_000_000))

    def make(n: int, src: np.ndarray, dst: np.ndarray, **kw: object) -> GraphStore:
        indptr, indices = csr_from_edges(n, src, dst)
        path = tmp_path / f"store{next(counter)}"
        write_store(path, indptr=indptr, indices=indices, **kw)
        return open_store(path)

    return make
