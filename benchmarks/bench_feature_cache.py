"""Which remote rows a rank should cache: VIP (the analytical ranking ``--feature-cache`` uses) against a degree
ranking, a simulated frequency ranking and the hindsight optimum, on the rows the ranks really fetch.

    python -m benchmarks.bench_feature_cache --store STORE --layout PART_DIR [--ranks 2] [--frac 0.1]

For each rank of a ``--strategy mini --parts-dir PART_DIR --nproc R`` run, sample the epochs its loader would
draw (the same targets, batch share, fanouts and seeds; no model: which rows a batch needs does not depend on
it) and count how often each remote row (owned by another rank) is an input. A cache of ``--frac`` of the
rank's remote rows, chosen by each ranking, then saves the fetches of the rows it holds. Rankings:

* ``vip``: SALIENT++'s analytical inclusion probability for the rank's targets (``trellis.loader.buffer.vip``;
  what ``--feature-cache`` fills with);
* ``degree``: out-degree (how many nodes list the row as an in-neighbour), the usual cache policy (PaGraph);
* ``simulated``: access counts over ``--sim-epochs`` other epochs (SALIENT++'s ``vip_simulation``);
* ``optimum``: the evaluated epoch's own counts (hindsight: no ranking can save more).

Reported: remote rows and MiB fetched per epoch without a cache and with each, summed over the ranks, and the
share of remote fetches each cache removes.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _counts(loader, owner: np.ndarray, rank: int, seed: int) -> np.ndarray:
    counts = np.zeros(owner.shape[0], dtype=np.int64)
    for batch in loader.epoch(seed, gather=False):
        ids = batch.node_ids.numpy()
        away = ids[owner[ids] != rank]
        counts += np.bincount(away, minlength=owner.shape[0])
    return counts


def main(argv: list[str] | None = None) -> None:
    from trellis.data.store import GraphStore
    from trellis.loader.blocks import parse_fanouts
    from trellis.loader.buffer import vip
    from trellis.loader.sampler import NeighborLoader, NeighborSampler
    from trellis.train.strategies.dist_mini import rank_of_part

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--frac", type=float, default=0.1, help="cache size as a share of a rank's remote rows")
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batch-size", type=int, default=1024, help="the step's batch (each rank takes its share)")
    p.add_argument("--sim-epochs", type=int, default=3)
    a = p.parse_args(argv)

    store = GraphStore(a.store)
    indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
    node_part = np.load(f"{a.layout}/node_parts.npy").astype(np.int64)
    owner = rank_of_part(int(node_part.max()) + 1, a.ranks)[node_part]
    train = np.asarray(store.split("train"), dtype=np.int64)
    fanouts = parse_fanouts(a.fanouts, 2)
    dim = int(np.prod(store.x.shape[1:])) if store.x is not None else 1
    out_degree = np.bincount(indices, minlength=store.num_nodes)
    sampler = NeighborSampler(indptr, indices, fanouts)
    totals = {k: 0 for k in ("none", "vip", "degree", "simulated", "optimum")}
    for rank in range(a.ranks):
        targets = train[owner[train] == rank]
        batch = max(1, -(-a.batch_size * targets.shape[0] // train.shape[0]))
        loader = NeighborLoader(sampler, targets, batch, seed=rank, prefetch=1)
        evaluated = _counts(loader, owner, rank, 0)
        simulated = sum(_counts(loader, owner, rank, s) for s in range(1, a.sim_epochs + 1))
        remote = np.flatnonzero(owner != rank)
        size = int(a.frac * remote.shape[0])
        scores = {"vip": vip(indptr, indices, targets, fanouts, batch)[remote], "degree": out_degree[remote],
                  "simulated": simulated[remote], "optimum": evaluated[remote]}
        totals["none"] += int(evaluated.sum())
        for name, score in scores.items():
            cached = remote[np.argsort(-score, kind="stable")[:size]]
            totals[name] += int(evaluated.sum() - evaluated[cached].sum())
        print(f"rank {rank}: {targets.shape[0]:,} targets, batch {batch}, {remote.shape[0]:,} remote rows, cache "
              f"{size:,} rows ({size * dim * 4 / 2**20:,.1f} MiB)", flush=True)
    none = max(1, totals["none"])
    print(f"\n{a.store} over {a.layout}: {a.ranks} ranks, fanouts {a.fanouts}, batch {a.batch_size} per step, cache "
          f"{a.frac:.0%} of each rank's remote rows\n")
    print("| cache ranking | remote rows / epoch | MiB / epoch | remote fetches removed |")
    print("|---|---|---|---|")
    for name, rows in totals.items():
        print(f"| {'no cache' if name == 'none' else name} | {rows:,} | {rows * dim * 4 / 2**20:,.1f} | "
              f"{1 - rows / none:.1%} |")
    print(json.dumps({k: {"rows": v, "removed": 1 - v / none} for k, v in totals.items()}))


if __name__ == "__main__":
    main()
