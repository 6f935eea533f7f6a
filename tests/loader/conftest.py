"""Small random graphs shared by the loader tests (no downloads, no generator dependency)."""

import numpy as np
import pytest


def random_csr(n=300, avg_deg=8, seed=0, hubs=True):
    """A random in-edge CSR without duplicate edges; a few hub destinations have high in-degree."""
    rng = np.random.default_rng(seed)
    e = n * avg_deg
    dst = rng.integers(0, n, e)
    src = rng.integers(0, n, e)
    if hubs:
        extra = rng.integers(0, n, 4 * n)
        dst = np.concatenate([dst, np.full(4 * n, 3)])  # node 3: in-degree ~4n (a hub)
        src = np.concatenate([src, extra])
    key = np.unique(dst.astype(np.int64) * n + src)
    dst, src = key // n, key % n
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src.astype(np.int64)


@pytest.fixture
def csr():
    return random_csr()
