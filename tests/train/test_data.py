"""``trellis.train.data``: what a run trains on, loaded from a store."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from trellis.data.importers import import_graph
from trellis.data.store import GraphStore
from trellis.ops.sparse_rows import to_sparse_rows
from trellis.train import trainer
from trellis.train.config import TrainConfig
from trellis.train.data import normalize_features, sparse_rows_of


@pytest.fixture(scope="module")
def cora(dataset, tmp_path_factory):
    return import_graph(dataset("cora"), tmp_path_factory.mktemp("cora") / "cora", format="planetoid",
                        progress=False)


@pytest.mark.parametrize("chunk_bytes", [4096, 10**5, 32 * 2**20])
def test_sparse_rows_built_by_chunks_are_the_dense_paths_bits(cora, chunk_bytes):
    """Bag-of-words rows were copied dense, normalized and converted (Coauthor CS: 1.1 GiB to keep 13 MB);
    built a chunk of rows at a time they must be the same CSR tensor, bit for bit."""
    s = GraphStore(cora)
    norm = s.preferred_feature_norm
    dense, _ = normalize_features(torch.from_numpy(np.array(s.x, dtype=np.float32)), norm)
    want = to_sparse_rows(dense)
    got = sparse_rows_of(s.x, norm, chunk_bytes=chunk_bytes)
    assert got is not None and got.layout == want.layout == torch.sparse_csr
    for a, b in ((got.crow_indices(), want.crow_indices()), (got.col_indices(), want.col_indices()),
                 (got.values(), want.values())):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert sparse_rows_of(np.ones((5, 4), np.float32), "row") is None  # dense rows stay dense


def test_word_counts_stored_as_integers_convert_as_floats_do(cora):
    """Counts stored as integers took the dense path (a rank copied its part dense first); they convert alike."""
    s = GraphStore(cora)
    counts = np.asarray(s.x).astype(np.uint8)
    got = sparse_rows_of(counts, "row", chunk_bytes=1 << 16)
    want = sparse_rows_of(counts.astype(np.float32), "row", chunk_bytes=1 << 16)
    assert got is not None and want is not None
    assert torch.equal(got.to_dense(), want.to_dense()) and torch.equal(got.crow_indices(), want.crow_indices())


def test_a_runs_peak_memory_includes_loading_its_data(sbm_store, tmp_path, monkeypatch):
    """The summary's peak RssAnon was sampled from after the data was loaded, so a load's transient copies
    (the run's real peak on Coauthor CS: 1,143 MiB against 259 reported) were missed."""
    from trellis.train.strategies.full import FullBatch

    load = FullBatch.load

    def load_with_a_transient_copy(self):
        block = np.ones(256 * 2**20 // 8)  # 256 MiB, touched, then freed before training starts
        time.sleep(0.1)  # the sampler's thread reads every 10 ms
        del block
        load(self)

    def run(out: str) -> float:
        cfg = TrainConfig(store=str(sbm_store), epochs=1, hidden=8, out=str(tmp_path / out), progress=False)
        return float(trainer.train(cfg)["peak_rss_anon_mb"])

    plain = run("plain")
    monkeypatch.setattr(FullBatch, "load", load_with_a_transient_copy)
    assert run("copy") >= plain + 200
