"""A user-written GCN against the built-in one: the pushdown must make user layers as fast as built-ins.

    python -m benchmarks.bench_user_layers [--nodes 100000] [--degree 10] [--features 128] [--hidden 64]

Three two-layer GCNs with the same weights train full-batch on one generated graph, interleaved round by round
(median training-step time: forward, backward, Adam step):

* ``built-in``: ``trellis.nn.GCNConv``;
* ``user (pushdown)``: the GCN a user writes as message / aggregate / update (``examples/user_layers.py``'s
  ``UserGCN``), which the planner recognizes and runs as one SpMM reordered with its transform;
* ``user (general plan)``: the same layer with a message that also reads ``x_i`` (unused), which the planner
  cannot push down: per-edge messages are materialized and segment-reduced, as a framework without pushdown
  (PyG's ``MessagePassing`` without a fused ``message_and_aggregate``) runs every user layer.

Printed: each step time and its ratio to the built-in's (acceptance: user pushdown <= 1.1x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import print_table
from examples.user_layers import UserGCN
from trellis.nn import GNN, GCNConv
from trellis.ops.graph import CSRGraph


class GeneralGCN(UserGCN):
    """The same layer, whose message reads ``x_i``: the planner cannot push it down."""

    def message(self, x_j, x_i, edge_weight):  # type: ignore[no-untyped-def,override]
        return edge_weight.unsqueeze(-1) * x_j


def _graph(n: int, degree: int, seed: int) -> CSRGraph:
    rng = np.random.default_rng(seed)
    e = n * degree
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return CSRGraph.from_numpy(indptr, src[order].astype(np.int64), n)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--degree", type=int, default=10)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    g = _graph(a.nodes, a.degree, 0)
    x = torch.randn(a.nodes, a.features)
    y = torch.randint(0, a.classes, (a.nodes,))
    dims = [(a.features, a.hidden), (a.hidden, a.classes)]
    models = {"built-in": GNN([GCNConv(i, o) for i, o in dims], 0.5),
              "user (pushdown)": GNN([UserGCN(i, o) for i, o in dims], 0.5),
              "user (general plan)": GNN([GeneralGCN(i, o) for i, o in dims], 0.5)}
    state = models["built-in"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    opts = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, m in models.items()}

    def step(name: str) -> float:
        m, opt = models[name], opts[name]
        m.train()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(g, x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(a.rounds + 1):  # round 0 warms up (plans, caches of the graph's normalization)
        for name in models:
            dt = step(name)
            if r:
                times[name].append(dt)
    base = statistics.median(times["built-in"])
    rows = [{"layer": k, "step_s": statistics.median(v), "vs built-in": statistics.median(v) / base}
            for k, v in times.items()]
    print(f"GCN, 2 layers, {a.nodes:,} nodes, {a.nodes * a.degree:,} edges, {a.features} features, hidden {a.hidden}; "
          f"median of {a.rounds} interleaved training steps, {torch.get_num_threads()} threads")
    print_table(rows, ["layer", "step_s", "vs built-in"])


if __name__ == "__main__":
    main()
