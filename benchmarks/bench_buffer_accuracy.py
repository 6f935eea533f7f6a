"""Accuracy of training through a partition buffer against neighbour sampling in memory, over seeds.

    python -m benchmarks.bench_buffer_accuracy [--datasets amazon-computers,coauthor-cs] [--seeds 5]

For each data set (the Shchur et al. npz files in ``TRELLIS_DATA_DIR``): partition into ``--parts`` (METIS),
then per seed train GraphSAGE three ways with the same hyperparameters and report test accuracy at the best
validation epoch (exact layer-wise evaluation in every case):

* ``memory``: ``--strategy mini`` (the whole graph sampled);
* ``buffer+cache``: ``--buffer-parts K`` plus a cache of ``--cache-frac`` of the rows ranked by inclusion
  probability (the design Trellis uses under a budget);
* ``in-buffer only``: ``--buffer-parts K`` and ``--buffer-cache 0`` (MariusGNN's in-buffer sampling);
* ``buffer + replay``: in-buffer sampling plus ``--buffer-replay R`` rehearsal batches (``--replay``), which
  keep min-cut parts that follow the labels from skewing the model, each step rehearsing
  ``--replay-share`` of a batch's targets (the model's first-layer aggregation kept, not the input rows),
  sampled at ``--replay-fanouts`` (default: the buffer's, the target layer's fanout halved);
* ``replay (run's fanouts)``: the same with rehearsal batches sampled at ``--fanouts``;
* ``replay (input rows)``: the design before collapsed rehearsal batches: every input row of a rehearsal
  batch kept (a step rehearsing a whole batch's targets, at ``--fanouts``) (``--configs`` picks among these).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _store(name: str, root: Path) -> Path:
    from trellis.data.importers import import_graph

    data = Path(os.environ.get("TRELLIS_DATA_DIR", ROOT.parent / "shared" / "data"))
    src = data / name
    if not src.exists():
        raise SystemExit(f"{src}: not found; set TRELLIS_DATA_DIR")
    return import_graph(src, root / name, progress=False)


@contextlib.contextmanager
def _input_rows(on: bool) -> Iterator[None]:
    """Rehearsal batches kept with every input row (the design before collapsed ones), while ``on``."""
    import trellis.train.strategies.buffered as buffered

    keep = buffered.input_aggregation
    if on:
        buffered.input_aggregation = lambda model: None
    try:
        yield
    finally:
        buffered.input_aggregation = keep


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="amazon-computers,coauthor-cs")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--buffer-parts", type=int, default=2)
    p.add_argument("--cache-frac", type=float, default=0.125)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--fanouts", default="10,5")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--method", default="metis", help="partitioner of the layout (default: metis)")
    p.add_argument("--configs", default="memory,buffer+cache,in-buffer only")
    p.add_argument("--store", help="a store (e.g. a generated graph) instead of --datasets")
    p.add_argument("--layout", help="--store's partitioned layout (default: partition it here)")
    p.add_argument("--cache-buffer-parts", type=int, default=0,
                   help="resident parts of the buffer+cache configuration (default: --buffer-parts)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--replay-share", type=float, default=1.0,
                   help="--buffer-replay-share of the 'buffer + replay' configuration (default: 1)")
    p.add_argument("--replay-fanouts", default=None,
                   help="--buffer-replay-fanouts of the 'buffer + replay' configuration (default: the buffer's)")
    p.add_argument("--replay", type=int, default=128,
                   help="--buffer-replay of the 'buffer + replay' configuration (in-buffer sampling plus "
                        "rehearsal batches; default: 128)")
    a = p.parse_args(argv)

    from trellis.data.store import GraphStore
    from trellis.partition import partition_graph
    from trellis.partition.layout import write_layout
    from trellis.train.config import TrainConfig
    from trellis.train.trainer import train

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = [a.store] if a.store else a.datasets.split(",")
        for name in names:
            store = Path(a.store) if a.store else _store(name, root)
            s = GraphStore(store)
            per_class = s.manifest.get("source", {}).get("split") == "per-class"
            name = Path(name).name
            layout = (Path(a.layout) if a.layout else
                      write_layout(s, partition_graph(s, a.method, a.parts, measure=False), root / f"{name}-p"))
            row_bytes = s.num_features * 4 + int(s.num_edges / s.num_nodes * 32) + 16
            cache = int(a.cache_frac * s.num_nodes) * row_bytes
            configs = {"memory": {}, "buffer+cache": dict(parts_dir=str(layout),
                                                          buffer_parts=a.cache_buffer_parts or a.buffer_parts,
                                                          buffer_cache=str(cache)),
                       "in-buffer only": dict(parts_dir=str(layout), buffer_parts=a.buffer_parts, buffer_cache="0"),
                       "buffer + replay": dict(parts_dir=str(layout), buffer_parts=a.buffer_parts, buffer_cache="0",
                                               buffer_replay=a.replay, buffer_replay_share=a.replay_share,
                                               buffer_replay_fanouts=a.replay_fanouts)}
            # rehearsal batches sampled at the run's fanouts (the default before they had their own)
            configs["replay (run's fanouts)"] = dict(configs["buffer + replay"], buffer_replay_fanouts=a.fanouts)
            # the design before collapsed rehearsal batches: every input row kept, a step rehearsing a whole batch
            configs["replay (input rows)"] = dict(configs["buffer + replay"], buffer_replay_share=1.0,
                                                  buffer_replay_fanouts=a.fanouts)
            configs = {k: v for k, v in configs.items() if k in a.configs.split(",")}
            acc: dict[str, list[float]] = {k: [] for k in configs}
            epoch_s: dict[str, list[float]] = {k: [] for k in configs}
            for seed in range(a.seeds):
                for label, kw in configs.items():
                    cfg = TrainConfig(store=str(store), strategy="mini", model="sage", hidden=a.hidden,
                                      fanouts=a.fanouts, batch_size=a.batch_size, epochs=a.epochs, patience=a.epochs,
                                      seed=seed, split_seed=seed if per_class else None,
                                      out=str(root / f"{name}-{label}-{seed}"), progress=False, device="cpu",
                                      checkpoint_every=0, **kw)
                    with _input_rows(label == "replay (input rows)"):
                        summary = train(cfg)
                    acc[label].append(float(summary["test_acc_mean"]))
                    last = (root / f"{name}-{label}-{seed}" / "metrics.jsonl").read_text().splitlines()[-1]
                    if "replay_rows" in last:  # the rehearsal batches' rows and bytes, against the data's
                        rec = json.loads(last)
                        print(f"  {label}: rehearsal holds {rec['replay_rows'] / s.num_nodes:.1%} of the rows in "
                              f"{rec['replay_bytes'] / (s.num_nodes * s.num_features * 4):.1%} of the features' "
                              "bytes (4-bit rows)", flush=True)
                    epoch_s[label].append(float(summary["epoch_time_s_median"]))
                print(name, seed, {k: round(v[-1], 4) for k, v in acc.items()}, flush=True)
            results[name] = acc
            ref = statistics.mean(acc["memory"]) if "memory" in acc else 0.0
            parts = json.loads((layout / "manifest.json").read_text())["num_parts"]
            print(f"\n{name}: {parts} parts, {a.buffer_parts} resident, cache {a.cache_frac:.1%} of rows, "
                  f"{a.seeds} seeds (mean ± std test accuracy)")
            for label, v in acc.items():
                sd = statistics.stdev(v) if len(v) > 1 else 0.0
                print(f"  {label:<16} {100 * statistics.mean(v):6.2f} ± {100 * sd:4.2f}   "
                      f"{100 * (statistics.mean(v) - ref):+6.2f} points vs memory   "
                      f"training step {statistics.median(epoch_s[label]):.2f} s (median)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
