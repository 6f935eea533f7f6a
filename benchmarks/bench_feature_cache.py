"""Which remote rows a rank should cache: VIP (the analytical ranking ``--feature-cache`` uses) against a degree
ranking, a simulated frequency ranking and the hindsight optimum, on the rows the ranks really fetch.

    python -m benchmarks.bench_feature_cache --store STORE --layout PART_DIR [--ranks 2] [--frac 0.1]
    python -m benchmarks.bench_feature_cache --store STORE --layout PART_DIR --ranks 4 --hosts 2  # + grouping

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

With ``--hosts H``, Armada's mini-batch grouping is simulated on the same batches: the ranks sit on H hosts
(consecutive ranks together), a host holds its ranks' parts, and the rows the batches of one step need from
other hosts are counted once per rank (every rank fetches its own) and once per host (the unique rows of the
step's batches on that host, fetched once: grouping). Grouping itself is not built; this measures what it
would save.
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


def _grouping(per_rank: list[list[np.ndarray]], host_of_node: np.ndarray, hosts: int) -> tuple[int, int]:
    """Rows fetched from other hosts per epoch: each rank for itself, and each host once per step (grouped)."""
    ranks = len(per_rank)
    host_of_rank = np.arange(ranks) * hosts // ranks
    alone = grouped = 0
    for step in range(max(len(b) for b in per_rank)):
        for h in range(hosts):
            need = [b[step][host_of_node[b[step]] != h] for r, b in enumerate(per_rank)
                    if host_of_rank[r] == h and step < len(b)]
            alone += sum(int(x.shape[0]) for x in need)
            grouped += int(np.unique(np.concatenate(need)).shape[0]) if need else 0
    return alone, grouped


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
    p.add_argument("--hosts", type=int, default=0, help="also simulate grouping with the ranks on H hosts")
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
    per_rank: list[list[np.ndarray]] = []
    for rank in range(a.ranks):
        targets = train[owner[train] == rank]
        batch = max(1, -(-a.batch_size * targets.shape[0] // train.shape[0]))
        loader = NeighborLoader(sampler, targets, batch, seed=rank, prefetch=1)
        evaluated = _counts(loader, owner, rank, 0)
        if a.hosts:
            per_rank.append([b.node_ids.numpy().copy() for b in loader.epoch(0, gather=False)])
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
    out = {k: {"rows": v, "removed": 1 - v / none} for k, v in totals.items()}
    if a.hosts:
        alone, grouped = _grouping(per_rank, owner * a.hosts // a.ranks, a.hosts)
        print(f"\ngrouping (simulated), {a.ranks} ranks on {a.hosts} hosts: rows from other hosts per epoch "
              f"{alone:,} fetched per rank, {grouped:,} per host and step ({1 - grouped / max(1, alone):.1%} fewer, "
              f"{alone * dim * 4 / 2**20:,.1f} -> {grouped * dim * 4 / 2**20:,.1f} MiB)")
        out["grouping"] = {"per_rank_rows": alone, "grouped_rows": grouped}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
