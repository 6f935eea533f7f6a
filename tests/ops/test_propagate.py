"""Every propagation operator equals a dense reference; row blocks and kernels do not change results."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg as sla
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.errors import TrellisUserError
from trellis.ops.propagate import OperatorSpec, degrees, iter_hops, propagate
from trellis.utils.numba import WITH_NUMBA

KERNELS = ["scipy"] + (["numba"] if WITH_NUMBA else [])


def random_graph(n: int, p: float, seed: int, weighted: bool = False, directed: bool = True):
    rng = np.random.default_rng(seed)
    a = (rng.random((n, n)) < p).astype(np.float64)
    np.fill_diagonal(a, 0.0)
    if not directed:
        a = np.maximum(a, a.T)
    if weighted:
        a = a * rng.uniform(0.1, 2.0, size=(n, n))
    csr = sp.csr_matrix(a)  # row = destination, column = source (in-edge CSR)
    w = csr.data.astype(np.float32) if weighted else None
    return a, csr.indptr.astype(np.int64), csr.indices.astype(np.int64), w


def dense_operator(a: np.ndarray, spec: OperatorSpec, exact: bool = False) -> np.ndarray:
    n = a.shape[0]
    at = a + np.eye(n)
    d = at.sum(axis=1)
    if spec.name == "rw":
        return at / d[:, None]
    t = at / np.sqrt(d)[:, None] / np.sqrt(d)[None, :]
    if spec.name == "sym":
        return t
    if spec.name == "ppr":
        if exact:
            return spec.alpha * np.linalg.inv(np.eye(n) - (1 - spec.alpha) * t)
        z = np.eye(n)  # K power iterations from Z = I, as the streaming code does per hop
        for _ in range(spec.num_iters):
            z = (1 - spec.alpha) * t @ z + spec.alpha * np.eye(n)
        return z
    if exact:
        return sla.expm(-spec.t * (np.eye(n) - t))
    out = np.zeros((n, n))
    term = np.eye(n)
    coef = np.exp(-spec.t)
    out += coef * term
    for k in range(1, spec.num_iters + 1):
        term = t @ term
        coef *= spec.t / k
        out += coef * term
    return out


def check_hops(hs: list[np.ndarray], b: np.ndarray, x: np.ndarray, tol: float) -> None:
    ref = x.astype(np.float64)
    for r, h in enumerate(hs):
        assert h.dtype == np.float32
        np.testing.assert_allclose(h, ref, rtol=tol, atol=tol, err_msg=f"hop {r}")
        ref = b @ ref


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("op", ["sym", "rw", "ppr", "heat"])
@pytest.mark.parametrize("weighted", [False, True])
def test_operator_equals_dense_reference(op: str, weighted: bool, kernel: str) -> None:
    a, indptr, indices, w = random_graph(40, 0.12, seed=1, weighted=weighted)
    x = np.random.default_rng(2).standard_normal((40, 6)).astype(np.float32)
    spec = OperatorSpec(op)
    hs = propagate(indptr, indices, x, spec, 3, edge_weight=w, block_rows=7, kernel=kernel)
    assert len(hs) == 4
    check_hops(hs, dense_operator(a, spec), x, 2e-5)


@pytest.mark.parametrize("op,iters", [("ppr", 150), ("heat", 40)])
def test_truncations_converge_to_closed_form(op: str, iters: int) -> None:
    """Enough power iterations / Taylor terms reach alpha (I-(1-alpha)T)^-1 and expm(-t(I-T))."""
    a, indptr, indices, _ = random_graph(30, 0.15, seed=3, directed=False)
    x = np.random.default_rng(4).standard_normal((30, 4)).astype(np.float32)
    spec = OperatorSpec(op, iters=iters, alpha=0.2, t=2.5)
    hs = propagate(indptr, indices, x, spec, 2, block_rows=8)
    check_hops(hs, dense_operator(a, spec, exact=True), x, 1e-4)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 25), p=st.floats(0.0, 0.5), block=st.integers(1, 30), seed=st.integers(0, 10_000),
       op=st.sampled_from(["sym", "rw"]))
def test_blocks_and_kernels_agree(n: int, p: float, block: int, seed: int, op: str) -> None:
    """Any block size (including 1 and > N), any graph incl. isolated nodes: same as the dense product."""
    a, indptr, indices, _ = random_graph(n, p, seed)
    x = np.random.default_rng(seed).standard_normal((n, 3)).astype(np.float32)
    spec = OperatorSpec(op)
    b = dense_operator(a, spec)
    for kernel in KERNELS:
        check_hops(propagate(indptr, indices, x, spec, 2, block_rows=block, kernel=kernel), b, x, 2e-5)


def test_scratch_files_are_removed(tmp_path) -> None:
    _, indptr, indices, _ = random_graph(20, 0.2, seed=5)
    x = np.ones((20, 3), dtype=np.float32)
    scratch = tmp_path / "scratch"
    seen = []
    for r, h in iter_hops(indptr, indices, x, OperatorSpec("heat", iters=4), 3, scratch_dir=scratch, block_rows=6):
        seen.append(r)
        assert len(list(scratch.iterdir())) <= 4  # prev hop + acc + two Taylor terms at most
        assert np.isfinite(np.asarray(h)).all()
    assert seen == [0, 1, 2, 3]
    assert list(scratch.iterdir()) == []


def test_rows_sum_to_one_for_rw_and_ppr() -> None:
    """Row-stochastic operators map constant features to constants (a sanity check on normalization)."""
    _, indptr, indices, _ = random_graph(50, 0.1, seed=6)
    x = np.ones((50, 2), dtype=np.float32)
    for h in propagate(indptr, indices, x, "rw", 3)[1:]:
        np.testing.assert_allclose(h, 1.0, rtol=1e-5)


def test_degrees_weighted_streaming() -> None:
    a, indptr, _, w = random_graph(33, 0.2, seed=7, weighted=True)
    np.testing.assert_allclose(degrees(indptr, w, block_rows=5), a.sum(axis=1) + 1.0, rtol=1e-6)


def test_bad_inputs() -> None:
    _, indptr, indices, _ = random_graph(5, 0.5, seed=8)
    x = np.ones((5, 2), dtype=np.float32)
    with pytest.raises(TrellisUserError, match="hops"):
        propagate(indptr, indices, x, "sym", 0)
    with pytest.raises(TrellisUserError, match="unknown operator"):
        OperatorSpec("laplacian")
    with pytest.raises(TrellisUserError, match="alpha"):
        OperatorSpec("ppr", alpha=0.0)
    with pytest.raises(TrellisUserError, match="nodes"):
        propagate(indptr, indices, np.ones((4, 2), dtype=np.float32), "sym", 1)
    with pytest.raises(TrellisUserError, match="non-negative"):
        propagate(indptr, indices, x, "sym", 1, edge_weight=-np.ones(indices.shape[0], dtype=np.float32) * 5)
