"""Feature sources: memory, memory map and storage reads give the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.loader.features import ArrayRows, FeatureGather, FeatureSource, TensorRows, as_feature_source
from trellis.loader.pp import MemorySource, StorageSource
from trellis.loader.ppcache import PPSettings, ensure_pp
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.ops.propagate import OperatorSpec

from .conftest import random_csr
from .test_pp import make_store


@pytest.fixture
def table(tmp_path):
    x = np.random.default_rng(0).standard_normal((120, 7)).astype(np.float32)
    mm = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=x.shape)
    mm[:] = x
    mm.flush()
    return x, np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="r", shape=x.shape)


def test_memory_and_memmap_sources_give_equal_rows(table):
    x, mm = table
    ids = np.array([5, 0, 119, 5, 42])
    mem, mapped = TensorRows(torch.from_numpy(x)), ArrayRows(mm)
    assert isinstance(as_feature_source(mm), ArrayRows) and as_feature_source(mem) is mem
    for src in (mem, mapped, ArrayRows(x)):
        assert isinstance(src, FeatureSource)
        assert (src.num_rows, src.dim, src.row_shape, src.dtype) == (120, 7, (7,), torch.float32)
        assert src.nbytes == x.nbytes
        np.testing.assert_array_equal(src.gather(ids).numpy(), x[ids])
        np.testing.assert_array_equal(src.gather(torch.from_numpy(ids)).numpy(), x[ids])
        buf = src.new_buffer(8)
        rows = src.gather(ids, buf)
        assert rows.data_ptr() == buf.data_ptr()  # landed in the buffer, no allocation
        np.testing.assert_array_equal(src.read_ranges(np.array([3, 100]), np.array([6, 102])).numpy(),
                                      x[[3, 4, 5, 100, 101]])
        assert src.gather(np.zeros(0, dtype=np.int64)).shape == (0, 7)


def test_memmap_is_not_copied(table):
    _, mm = table
    src = ArrayRows(mm)
    assert np.shares_memory(src.x, mm)


def test_neighbor_loader_reads_features_from_any_source(table):
    x, mm = table
    indptr, indices = random_csr(n=120, seed=2)
    s = NeighborSampler(indptr, indices, [3, 2])
    ref = [b.x.clone() for b in NeighborLoader(s, np.arange(120), 25, x=x, seed=1, prefetch=0).epoch(0)]
    for feats in (mm, ArrayRows(mm), torch.from_numpy(x)):
        got = [b.x.clone() for b in NeighborLoader(s, np.arange(120), 25, x=feats, seed=1, prefetch=0).epoch(0)]
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_feature_gather_over_a_source_rotates_buffers(table):
    _, mm = table
    fg = FeatureGather(ArrayRows(mm), slots=2)
    a = fg.gather(np.array([1, 2, 3]), 0)
    b = fg.gather(np.array([4]), 2)
    assert a.data_ptr() == b.data_ptr() and fg.num_features == 7


def test_pp_memory_and_storage_sources_give_equal_rows(tmp_path):
    cache, _ = ensure_pp(make_store(tmp_path / "store"), tmp_path / "pp", PPSettings(OperatorSpec("sym"), hops=2),
                         progress=False, log=None)
    hops, rows = (0, 2), (10, 250)
    mem = MemorySource(cache, hops, rows)
    sto = StorageSource(cache, hops, rows, min_read_bytes=0)
    try:
        ids = np.array([0, 7, 3, 239, 100])
        want = np.stack([np.asarray(cache.hop(h))[10:250][ids] for h in hops], 1)
        for src in (mem, sto):
            assert (src.num_rows, src.dim, src.row_shape) == (240, cache.num_features, (2, cache.num_features))
            assert src.nbytes == 240 * 2 * cache.row_bytes
            np.testing.assert_array_equal(src.gather(ids).numpy(), want)
            np.testing.assert_array_equal(src.gather(ids, src.new_buffer(5)).numpy(), want)
            got = src.read_ranges(np.array([4, 30]), np.array([9, 31]))
            np.testing.assert_array_equal(got.numpy(), mem.gather(np.array([4, 5, 6, 7, 8, 30])).numpy())
        assert sto.on_storage and not mem.on_storage and mem.range_views
    finally:
        sto.close()


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 64 * 2**20])
def test_copy_rows_holds_the_rows_a_batch_gathers(chunk_bytes):
    """The device copy of ``--feature-residency device`` is made through the source's gather, chunk by chunk:
    rows normalized at gather come out exactly as a batch would gather them, whatever the chunk size."""
    from trellis.loader.features import NormalizedRows, copy_rows

    x = np.random.default_rng(0).random((1000, 37)).astype(np.float32)
    src = NormalizedRows(ArrayRows(x), "row")
    got = copy_rows(src, torch.device("cpu"), chunk_bytes=chunk_bytes)
    assert got.shape == (1000, 37)
    assert torch.equal(got, src.gather(np.arange(1000)))
    assert not torch.equal(got, torch.from_numpy(x))  # normalized, not the raw rows


@pytest.mark.parametrize("mode", ["row", "l2"])
def test_normalize_rows_a_few_rows_at_a_time_gives_the_whole_tensor_s_bits(dataset, tmp_path, mode):
    """normalize_rows_ took abs() of the whole tensor: a second copy of an evaluation's bag-of-words rows (Coauthor
    Physics: 1.16 GB, the mini-batch run's peak). Chunked, each row's norm is the same reduction: the same bits."""
    from trellis.data.importers import import_graph
    from trellis.data.store import open_store
    from trellis.loader.features import normalize_rows_

    cora = np.array(open_store(import_graph(dataset("cora"), tmp_path / "cora", format="planetoid",
                                            progress=False)).x, dtype=np.float32)
    dense = np.random.default_rng(0).standard_normal((300, 70)).astype(np.float32)
    for x in (cora, dense, dense[:, :1], np.zeros((3, 5), np.float32)):
        whole = torch.from_numpy(x.copy())
        norm = whole.abs().sum(dim=1, keepdim=True) if mode == "row" else whole.norm(dim=1, keepdim=True)
        whole.div_(norm.clamp_(min=torch.finfo(torch.float32).tiny))  # the one-tensor arithmetic it replaced
        for chunk in (1, 1000, x.size + 1):
            got = x.copy()
            normalize_rows_(got, mode, chunk=chunk)
            assert np.array_equal(got, whole.numpy())


def test_sparse_rows_gather_the_csr_that_converting_the_dense_gather_gives(dataset, tmp_path):
    """A batch strategy on a bag-of-words store gathers CSR rows (SparseRows); a run whose rows stay dense (a rank,
    the partition buffer, a copy on the device) converts each gathered batch instead. Both must be one CSR, bit for
    bit: Cora's rows, L1-normalized, in any order and with repeats."""
    from trellis.data.importers import import_graph
    from trellis.data.store import open_store
    from trellis.loader.features import NormalizedRows, SparseRows
    from trellis.ops.sparse_rows import to_sparse_rows
    from trellis.train.data import sparse_rows_of

    x = open_store(import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)).x
    dense = NormalizedRows(ArrayRows(x), "row")
    rows = SparseRows(sparse_rows_of(x, "row", chunk_bytes=1 << 16))
    assert rows.nbytes < ArrayRows(x).nbytes / 10 and rows.new_buffer(100).numel() == 0
    ids = np.random.default_rng(0).integers(0, x.shape[0], 500)
    assert rows.gather(np.zeros(0, dtype=np.int64)).shape == (0, x.shape[1])
    for pick in (ids, np.sort(ids), np.array([5, 5, 0, x.shape[0] - 1])):
        got, want = rows.gather(pick), to_sparse_rows(dense.gather(pick), max_density=1.0)
        assert got.shape == (pick.shape[0], x.shape[1])
        for a, b in ((got.crow_indices(), want.crow_indices()), (got.col_indices(), want.col_indices()),
                     (got.values(), want.values())):
            assert torch.equal(a, b)
    g = FeatureGather(rows)
    assert g.gather(ids, slot=0).layout == torch.sparse_csr  # no dense buffer is handed to a sparse source
