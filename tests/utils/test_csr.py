from __future__ import annotations

import numpy as np
import pytest

from trellis.utils.csr import build_reverse_csr, reverse_csr_into, row_blocks, row_ranges, stable_argsort


def random_csr(rng, n_dst, n_src, e):
    dst = np.sort(rng.integers(0, n_dst, e))
    indptr = np.zeros(n_dst + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n_dst), out=indptr[1:])
    return indptr, rng.integers(0, n_src, e).astype(np.int64)


def reference_reverse(indptr, indices, num_src):
    """Per-edge definition: reverse row s lists (dst, forward edge id) in ascending edge id."""
    rows = [[] for _ in range(num_src)]
    for d in range(indptr.shape[0] - 1):
        for k in range(indptr[d], indptr[d + 1]):
            rows[indices[k]].append((d, k))
    rev_indptr = np.cumsum([0] + [len(r) for r in rows])
    flat = [p for r in rows for p in r]
    return rev_indptr, np.array([d for d, _ in flat], dtype=np.int64), np.array([k for _, k in flat], dtype=np.int64)


@pytest.mark.parametrize(("n_dst", "n_src", "e"), [(5, 7, 0), (50, 50, 200), (300, 40, 5000), (40, 3000, 2000)])
def test_reverse_csr_matches_its_definition_in_memory_and_in_chunks(n_dst, n_src, e):
    rng = np.random.default_rng(e)
    indptr, indices = random_csr(rng, n_dst, n_src, e)
    want = reference_reverse(indptr, indices, n_src)
    for got, ref in zip(build_reverse_csr(indptr, indices, n_src), want):
        np.testing.assert_array_equal(got, ref)
    rev_indices, rev_perm = np.empty(e, np.int64), np.empty(e, np.int64)
    seen = []
    rev_indptr = reverse_csr_into(indptr, indices, n_src, rev_indices, rev_perm, chunk_edges=37, progress=seen.append)
    for got, ref in zip((rev_indptr, rev_indices, rev_perm), want):
        np.testing.assert_array_equal(got, ref)
    assert sum(seen) == e


def test_stable_argsort_counting_and_numpy_paths_agree():
    keys = np.random.default_rng(3).integers(0, 100, 10000)
    want = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(stable_argsort(keys, 100), want)
    np.testing.assert_array_equal(stable_argsort(keys, 100, use_numba=False), want)
    assert stable_argsort(keys, 100).dtype == np.int64


def test_row_blocks_cover_rows_within_the_edge_bound():
    indptr = np.array([0, 1, 1, 10, 12, 13, 20], dtype=np.int64)  # row 2 has 9 edges, more than the bound
    blocks = list(row_blocks(indptr, 4))
    assert blocks[0][0] == 0 and blocks[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    for r0, r1 in blocks:
        assert r1 > r0 and (indptr[r1] - indptr[r0] <= 4 or r1 == r0 + 1)
    assert list(row_ranges(7, 3)) == [(0, 3), (3, 6), (6, 7)]
