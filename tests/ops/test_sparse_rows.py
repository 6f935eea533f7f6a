"""Sparse input rows: the first layer's transform and dropout on a CSR input equal the dense ones."""

from __future__ import annotations

import torch

from trellis.ops.dropout import dropout
from trellis.ops.sparse_rows import is_sparse, linear, to_sparse_rows


def _bow(n=60, f=200, density=0.03, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, f, generator=g) < density
    return mask.float() * torch.randint(1, 4, (n, f), generator=g).float()


def test_only_sparse_float_matrices_are_converted():
    x = _bow()
    assert is_sparse(to_sparse_rows(x))
    dense = torch.rand(10, 5)
    assert to_sparse_rows(dense) is dense  # 100% non-zero
    ids = torch.zeros(10, 5, dtype=torch.int64)
    assert to_sparse_rows(ids) is ids


def test_linear_and_its_gradients_equal_the_dense_ones():
    x = _bow()
    xs = to_sparse_rows(x)
    w1 = torch.randn(7, x.shape[1], requires_grad=True)
    w2 = w1.detach().clone().requires_grad_(True)
    b = torch.randn(7)
    out_s, out_d = linear(xs, w1, b), linear(x, w2, b)
    assert torch.allclose(out_s, out_d, atol=1e-5)
    g = torch.randn_like(out_d)
    out_s.backward(g)
    out_d.backward(g)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-4)


def test_dropout_keeps_the_structure_and_zeros():
    x = _bow(n=400, f=300, density=0.05)
    xs = to_sparse_rows(x)
    gen = torch.Generator().manual_seed(1)
    d = dropout(xs, 0.5, True, gen)
    assert is_sparse(d) and torch.equal(d.crow_indices(), xs.crow_indices())
    kept = d.values() != 0
    assert torch.allclose(d.values()[kept], 2 * xs.values()[kept])  # inverted dropout's scale
    assert 0.4 < kept.float().mean().item() < 0.6
    assert dropout(xs, 0.5, False) is xs
    again = dropout(xs, 0.5, True, torch.Generator().manual_seed(1))
    assert torch.equal(again.values(), d.values())  # the mask is the generator's


def test_a_gcn_on_sparse_rows_equals_the_dense_model():
    from trellis.nn.batched import BatchedGNN
    from trellis.nn.models import build_model
    from trellis.ops.graph import CSRGraph

    torch.manual_seed(0)
    n = 60
    src = torch.randint(0, n, (300,))
    dst = torch.randint(0, n, (300,))
    order = torch.argsort(dst * n + src)
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
    graph = CSRGraph(indptr=indptr, indices=src[order], num_src=n)
    x = _bow(n=n)
    for name in ("gcn", "sage", "gin", "gat"):
        model = build_model(name, x.shape[1], 3, hidden=8, layers=2, dropout=0.0, heads=2)
        model.eval()
        run = BatchedGNN([model]) if name != "gat" else None
        out_d = run(graph, x)[0] if run else model(graph, x)
        out_s = run(graph, to_sparse_rows(x))[0] if run else model(graph, to_sparse_rows(x))
        assert torch.allclose(out_s, out_d, atol=1e-4), name


def test_sparse_dropout_is_the_dense_mask_at_every_stored_value():
    """A stored value at (row, column) gets the dense mask's value there, keyed rows included."""
    import numpy as np

    from trellis.ops.dropout import keyed_rows

    x = _bow(n=300, f=211, density=0.04)
    xs = to_sparse_rows(x)
    for keys in (None, np.random.default_rng(3).permutation(10_000)[:300].astype(np.int64)):
        with keyed_rows(nodes=keys):
            d = dropout(xs, 0.5, True, torch.Generator().manual_seed(9)).to_dense()
            dense = dropout(x, 0.5, True, torch.Generator().manual_seed(9))
        assert torch.equal(d, dense)
        assert int((d != 0).sum()) < int((x != 0).sum())  # something was dropped


def test_the_parallel_conversion_is_torch_s_csr():
    """to_sparse_rows builds the CSR with two numba passes (torch's conversion took 154 ms per Physics batch): the
    same row pointers, column order and values as ``to_sparse_csr``, in float32 and float64, with empty rows and
    negative zeros (not stored by either); a sparse input or one that needs gradients is returned as it is."""
    x = _bow(n=300, f=500, density=0.02)
    x[7] = 0.0
    x[8, 3] = -0.0
    for t in (x, x.double(), x[:, :257].contiguous(), x.t().contiguous().t()):
        got, want = to_sparse_rows(t), t.to_sparse_csr()
        for a, b in ((got.crow_indices(), want.crow_indices()), (got.col_indices(), want.col_indices()),
                     (got.values(), want.values())):
            assert a.dtype == b.dtype and torch.equal(a, b)
    xs = to_sparse_rows(x)
    assert to_sparse_rows(xs) is xs
    w = x.clone().requires_grad_(True)
    assert to_sparse_rows(w) is w
    assert is_sparse(to_sparse_rows(torch.ones(4, 4), max_density=1.0))  # a run that decided takes every batch


def test_head_rows_of_sparse_rows_are_the_first_rows():
    """A sampled block's root term reads the first rows of its sources: a CSR input is sliced through its arrays
    (torch's CSR tensors take no slices)."""
    from trellis.ops.sparse_rows import head_rows

    x = _bow(n=40, f=30, density=0.1)
    xs = to_sparse_rows(x, max_density=1.0)
    for n in (0, 1, 17, 40):
        got = head_rows(xs, n)
        assert (n == 40) == (got is xs)
        assert is_sparse(got) and torch.equal(got.to_dense(), x[:n])


def _mapped(x, tmp_path):
    """``x``'s CSR arrays written to files and memory-mapped, as the out-of-core strategy spills them."""
    import numpy as np

    from trellis.ops.sparse_rows import MappedSparseRows

    s = x.to_sparse_csr()
    arrays = []
    for name, t, dtype in (("p", s.crow_indices(), np.int64), ("i", s.col_indices(), np.int64),
                           ("v", s.values(), np.float32)):
        m = np.memmap(tmp_path / name, dtype=dtype, mode="w+", shape=(t.numel(),))
        m[:] = t.numpy()
        arrays.append(m)
    return MappedSparseRows(*arrays, width=x.shape[1])


def test_mapped_rows_are_the_matrix_rows_and_their_reads_add_up(tmp_path):
    x = _bow()
    m = _mapped(x, tmp_path)
    assert m.shape == tuple(x.shape)
    total = 0
    for r0, r1 in ((0, 7), (7, 8), (8, 8), (8, 60)):
        rows = m.rows(r0, r1)
        assert is_sparse(rows) and torch.equal(rows.to_dense(), x[r0:r1])
        total += m.rows_nbytes(r0, r1)
    nnz = int(torch.count_nonzero(x))
    assert total == m.rows_nbytes(0, 60) == nnz * 12 + 60 * 8


def test_a_tile_dropped_out_at_its_offset_seed_is_the_whole_matrix_rows(tmp_path):
    """A tile's sparse rows under ``tile_seed(seed, r0 * width)`` get the whole matrix's mask on those rows."""
    from trellis.ops.dropout import apply_sparse, tile_seed

    x = _bow()
    m = _mapped(x, tmp_path)
    whole = apply_sparse(m.rows(0, 60), 0.5, 1234).to_dense()
    assert 0 < int(torch.count_nonzero(whole)) < int(torch.count_nonzero(x))
    for r0, r1 in ((0, 13), (13, 40), (40, 60)):
        tile = apply_sparse(m.rows(r0, r1), 0.5, tile_seed(1234, r0 * x.shape[1])).to_dense()
        assert torch.equal(tile, whole[r0:r1])


def test_rows_used_once_leave_no_reference_cycle():
    """Unmemoized, a tile's graph and its reverse did not point at each other: the pair was a cycle that only the
    garbage collector freed, and out-of-core tiles' index arrays piled up past the memory budget."""
    import gc

    from trellis.ops.graph import CSRGraph
    from trellis.ops.sparse_rows import unmemoized

    xs = to_sparse_rows(_bow())
    w = torch.randn(5, xs.shape[1], requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with unmemoized():
            linear(xs, w).sum().backward()
        found = []
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [o for o in gc.garbage if isinstance(o, CSRGraph)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not found and w.grad is not None
