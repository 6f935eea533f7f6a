"""Tiled aggregation over row ranges of a memory-mapped CSR equals the in-memory SpMM row for row, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.ops import gcn_norm, spmm
from trellis.ops.graph import CSRGraph
from trellis.ops.tiled import MappedCSR, iter_tiles
from trellis.utils.csr import build_reverse_csr


def _graph(n: int = 200, e: int = 1500, seed: int = 0) -> tuple[CSRGraph, MappedCSR, torch.Tensor]:
    rng = np.random.default_rng(seed)
    dst = np.sort(rng.integers(0, n, e))
    dst[:5] = 0  # a hub at row 0, and rows without in-edges further on
    src = rng.integers(0, n, e)
    dst = np.sort(dst)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(indptr, dst + 1, 1)
    indptr = np.cumsum(indptr)
    rev = build_reverse_csr(indptr, src.astype(np.int64), n)
    g = CSRGraph.from_numpy(indptr, src, n, rev=rev)
    mg = MappedCSR(indptr, src.astype(np.int64), rev[0], rev[1])
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(seed))
    return g, mg, x


def _reference(kind: str, g: CSRGraph, x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """The in-memory SpMM's forward output, or its gradient w.r.t. the input for ``x`` as the output gradient."""
    ew, sw = gcn_norm(g) if kind == "gcn" else (None, None)
    reduce = "mean" if kind == "mean" else "sum"
    if not reverse:
        return spmm(g, x, ew, reduce=reduce, self_weight=sw)
    inp = torch.zeros_like(x).requires_grad_()
    spmm(g, inp, ew, reduce=reduce, self_weight=sw).backward(x)
    assert inp.grad is not None
    return inp.grad


@pytest.mark.parametrize("kind", ["gcn", "mean", "sum"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("bounds", [[0, 1, 2, 9, 200], [0, 7, 14, 21, 200], [0, 200]])
def test_tiles_equal_the_whole_graph_bit_for_bit(kind, reverse, bounds):
    g, mg, x = _graph()
    ref = _reference(kind, g, x, reverse)
    for r0, r1 in iter_tiles(np.asarray(bounds)):
        got = mg.aggregate(kind, mg.tile(r0, r1, reverse=reverse), x.numpy(), reverse=reverse)
        assert torch.equal(got, ref[r0:r1]), (kind, reverse, r0, r1)


def test_tiles_read_sources_from_a_memory_map(tmp_path):
    g, mg, x = _graph(seed=1)
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=tuple(x.shape))
    mm[:] = x.numpy()
    mm.flush()
    ro = np.load(tmp_path / "x.npy", mmap_mode="r")
    ref = _reference("gcn", g, x, False)
    got = torch.cat([mg.aggregate("gcn", mg.tile(a, b), ro) for a, b in ((0, 50), (50, 123), (123, 200))])
    assert torch.equal(got, ref)


def test_tile_bounds_cover_every_row_within_the_tile_budget():
    _, mg, _ = _graph()
    deg_f, deg_r = np.diff(mg.indptr), np.diff(mg.rev_indptr)
    for row_b, edge_b, tile_b in ((10.0, 8.0, 400.0), (1.0, 1.0, 3.0), (100.0, 8.0, 1e9)):
        b = mg.tile_bounds(row_b, edge_b, tile_b)
        assert b[0] == 0 and b[-1] == 200 and np.all(np.diff(b) >= 1)
        for r0, r1 in iter_tiles(b):
            cost = (r1 - r0) * row_b + max(deg_f[r0:r1].sum(), deg_r[r0:r1].sum()) * edge_b
            assert cost <= tile_b or r1 - r0 == 1  # a row alone over budget still gets its own tile
    assert np.all(np.diff(mg.tile_bounds(1.0, 1.0, 1e9, max_rows=7)) <= 7)
    assert len(mg.tile_bounds(1.0, 1.0, 1e9)) == 2


def test_an_unknown_aggregation_is_refused():
    _, mg, x = _graph()
    with pytest.raises(ValueError, match="no tiled aggregation 'max'"):
        mg.aggregate("max", mg.tile(0, 3), x.numpy())
