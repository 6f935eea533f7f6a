"""GCN on Platonov et al.'s heterophilous graphs over their fixed splits, beside their published figures.

    python -m benchmarks.bench_heterophily FILE.npz [--splits 10] [--configs pre-norm,post-norm,plain]

``FILE.npz`` is one of their files (``roman_empire.npz``, ``amazon_ratings.npz``, ``minesweeper.npz``,
``tolokers.npz``, ``questions.npz``; not shipped, never downloaded). It is imported once with
``trellis data import`` (their protocol: undirected, every node, the ten fixed splits), then each
configuration trains on the first ``--splits`` splits (``--split-seed K``) and the test metric at the best
validation epoch is reported as mean ± std, beside the published GCN (their Table 4: GCN with residual
connections and layer normalization, hidden 512, up to 5 layers, 1000 full-batch steps on a GPU).

Configurations (GCN, 3 graph layers, hidden 256, dropout 0.2, Adam lr 0.001, features as given, 400 epochs,
patience 100 — one CPU-sized recipe for all, not tuned per data set):

* ``pre-norm``: ``--pre-norm --norm layer``, their block order (input layer, ``h + act(conv(dropout(norm(h))))``,
  norm and output layer);
* ``post-norm``: ``--residual --norm layer``, Trellis's residual layers (norm after the aggregation);
* ``plain``: the default GCN (2 layers, hidden 16, dropout 0.5, lr 0.01).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

#: Published GCN test metric (mean, std over 10 splits), Platonov et al. 2023, Table 4.
PUBLISHED = {"roman_empire": (73.69, 0.74), "amazon_ratings": (48.70, 0.63), "minesweeper": (89.75, 0.52),
             "tolokers": (83.64, 0.67), "questions": (76.09, 1.27)}

RECIPE = {"layers": 3, "hidden": 256, "dropout": 0.2, "lr": 0.001, "weight_decay": 0.0, "feature_norm": "none",
          "epochs": 400, "patience": 100}
CONFIGS = {
    "pre-norm": {**RECIPE, "pre_norm": True, "norm": "layer"},
    "post-norm": {**RECIPE, "residual": True, "norm": "layer"},
    "plain": {"epochs": 400, "patience": 100},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("npz", type=Path, help="one of Platonov et al.'s npz files")
    ap.add_argument("--splits", type=int, default=10, help="fixed splits to train on (default 10)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    args = ap.parse_args()

    import trellis
    from trellis.data.importers import import_graph

    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    with tempfile.TemporaryDirectory(prefix="trellis-het-") as tmp:
        store = import_graph(args.npz, Path(tmp) / "store", progress=False)
        results: dict[str, list[float]] = {c: [] for c in names}
        seconds: dict[str, float] = {c: 0.0 for c in names}
        for k in range(args.splits):  # configurations interleaved per split
            for c in names:
                t0 = time.perf_counter()
                run = trellis.train(store, model="gcn", split_seed=k, **CONFIGS[c])
                seconds[c] += time.perf_counter() - t0
                results[c].append(100 * run.test_score())
                print(f"split {k} {c:>9}: test {results[c][-1]:.2f}", flush=True)
        metric = "ROC-AUC" if run.summary.get("metric") == "auc" else run.summary.get("metric", "")
        pub = PUBLISHED.get(args.npz.stem)
        print(f"\n{args.npz.stem}: test {metric} over {args.splits} split(s)")
        print("| configuration | Trellis | published GCN (Platonov et al.) | difference | wall per run |")
        print("|---|---|---|---|---|")
        for c in names:
            mean = statistics.fmean(results[c])
            std = statistics.stdev(results[c]) if len(results[c]) > 1 else 0.0
            ref = f"{pub[0]:.2f} ± {pub[1]:.2f}" if pub else "–"
            diff = f"{mean - pub[0]:+.2f}" if pub else "–"
            print(f"| {c} | {mean:.2f} ± {std:.2f} | {ref} | {diff} | {seconds[c] / args.splits:.0f} s |")


if __name__ == "__main__":
    main()
