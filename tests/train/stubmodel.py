"""A small stand-in for ``trellis.nn`` so the trainer is tested on its own, plus a graph-store maker.

:func:`stub_build` is a model factory: pass it as ``model_factory=`` to the trainer, the sweep or
``trellis.cli.main.main``; subprocess tests run ``python -c "import tests.train.stubmodel as s; s.run_cli()" ARGS``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trellis.data.store import write_store


class StubGNN(nn.Module):
    """Mean aggregation + linear per layer with dropout (dense torch ops, deterministic on CPU)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int, layers: int, dropout: float, use_graph: bool):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout
        self.use_graph = use_graph

    def _agg(self, graph, h):
        if not self.use_graph:
            return h
        dst = graph.dst_of_edges()
        out = torch.zeros_like(h).index_add_(0, dst, h[graph.indices]) + h
        return out / (graph.in_degree() + 1).unsqueeze(1)

    def forward(self, graph, x, return_embedding: bool = False):
        for i, lin in enumerate(self.lins):
            if return_embedding and i == len(self.lins) - 1:
                return x
            x = F.dropout(x, self.dropout, self.training)
            x = lin(self._agg(graph, x))
            if i < len(self.lins) - 1:
                x = F.relu(x)
        return x

    def explain(self, graph) -> str:
        return f"stub plan: {len(self.lins)} layers over {graph.num_edges} edges"


def stub_build(name, in_dim, out_dim, *, hidden=16, layers=2, heads=1, dropout=0.5, edge_dim=0, **extra):
    if extra:
        raise TypeError(f"unexpected model options {sorted(extra)}")
    return StubGNN(in_dim, out_dim, hidden, layers, dropout, use_graph=name != "mlp")


def run_cli() -> None:
    """Entry for subprocess tests: stub model, then the real CLI with ``sys.argv[1:]``.

    ``STUB_EPOCH_SLEEP`` (seconds) slows every forward pass so a test can signal the process mid-run
    without training for long; sleeping touches no RNG, so results are unchanged.
    """
    delay = float(os.environ.get("STUB_EPOCH_SLEEP", "0"))
    if delay:
        original = StubGNN.forward

        def slow(self, *args, **kwargs):
            time.sleep(delay)
            return original(self, *args, **kwargs)

        StubGNN.forward = slow
    from trellis.cli.main import main

    sys.exit(main(sys.argv[1:], model_factory=stub_build))


def make_sbm_store(out: Path, *, n: int = 300, classes: int = 3, features: int = 8, p_in: float = 0.05,
                   p_out: float = 0.005, seed: int = 0, signal: float = 0.6, nonneg: bool = False) -> Path:
    """A small planted-partition store with class-correlated features and a 20/30-per-class-ish split."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    same = y[:, None] == y[None, :]
    adj = rng.random((n, n)) < np.where(same, p_in, p_out)
    adj = np.triu(adj, 1)
    adj = adj | adj.T
    dst, src = np.nonzero(adj)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    centers = rng.normal(size=(classes, features))
    x = signal * centers[y] + rng.normal(size=(n, features))
    if nonneg:
        x = np.abs(x)
    perm = rng.permutation(n)
    splits = {"train": np.sort(perm[: n // 5]), "val": np.sort(perm[n // 5: n // 2]), "test": np.sort(perm[n // 2:])}
    return write_store(out, indptr=indptr, indices=src.astype(np.int64), x=x.astype(np.float32), y=y,
                       splits=splits, name="sbm-test", num_classes=classes)
