"""Model-batched sweep vs the same configurations trained one after another, with a time breakdown.

    python -m benchmarks.bench_sweep [--graphs sbm-100k,amazon-computers] [--epochs 10] [--ks auto,1,4,12]
                                     [--cli-baseline] [--breakdown] [--ab 12,4 [--only-ab]] [--json]

12 GCN configurations (2 layers; hidden 64/128/256 x lr 0.01/0.005 x dropout 0.3/0.5) on a generated
100k-node / 2M-edge planted-partition graph (128 features, 16 classes; the graph of bench_fullbatch) and on
Amazon Computers (imported from ../shared/data with the npz importer). Each measurement runs in its own
process:

* ``solo``: ``Trainer.fit`` per configuration, one after another in one process (what ``trellis train``
  does per run, without the interpreter start); ``--cli-baseline`` also runs 12 ``trellis train``
  processes;
* ``sweep K``: ``run_sweep`` with ``--batch-models K`` (``auto``: the planner's choice).

Every run trains a fixed number of epochs (patience = epochs) so the times compare like for like; the
per-epoch losses of every configuration are compared between the solo runs and each sweep (max abs
difference). ``--breakdown`` profiles one epoch (training step + evaluation pass) of each solo
configuration and of the batched model, and splits the time into aggregation (the graph engine's SpMM,
forward and backward), dense matmuls, dropout's random numbers and the rest (elementwise, copies, loss):
what batching can share (the aggregation's random row accesses and, for evaluation, the cached first
aggregation) versus what it cannot (every configuration's own matmuls and masks). ``--ab K`` alternates
one epoch of the 12 solo models with one epoch of the batched model(s) a few times (robust to a shared
machine's drifting load; the speedup is the median of the per-repetition ratios) and repeats it with the
rewrites off, which isolates batching itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, run_isolated

CACHE = Path(tempfile.gettempdir()) / "trellis-bench-graphs"
AMAZON = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "amazon-computers"
GRID = ["hidden=64,128,256", "lr=0.01,0.005", "dropout=0.3,0.5"]


def graph_store(name: str) -> str:
    """The store of a benchmark graph (generated or imported once, then cached)."""
    if name == "sbm-100k":
        from benchmarks.bench_fullbatch import graph_store as fullbatch_store

        return fullbatch_store("100k")
    if name == "amazon-computers":
        out = CACHE / "amazon-computers"
        if not (out / "manifest.json").exists():
            from trellis.data.importers.npz import import_npz

            import_npz(AMAZON, out, name="amazon-computers", progress=False)
        return str(out)
    if name.startswith("sbm-small"):  # quick check of the script itself
        out = CACHE / "sbm-small"
        if not (out / "manifest.json").exists():
            from trellis.data.generate import generate_sbm

            generate_sbm(out, nodes=3000, avg_degree=10, features=32, classes=4, seed=0, progress=False)
        return str(out)
    raise SystemExit(f"unknown graph {name!r}")


def _configs(store: str) -> list[Any]:
    from trellis.train.sweep import SweepConfig, make_entries, parse_grid

    return make_entries(SweepConfig(store=store, model="gcn", grid=parse_grid(GRID), device="cpu"))


def _losses(run_dir: Path) -> list[float]:
    from trellis.train.runs import read_jsonl

    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def _child(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from trellis.train.config import TrainConfig
    from trellis.train.sweep import SweepConfig, parse_grid, run_sweep
    from trellis.train.trainer import Trainer

    work = Path(args["work"])
    epochs = args["epochs"]
    if args["mode"] == "solo":
        entries = _configs(args["store"])
        t0 = time.perf_counter()
        train_s, losses = 0.0, {}
        for e in entries:
            values = {**e.cfg.to_dict(), "epochs": epochs, "patience": epochs, "out": str(work / "solo" / e.id),
                      "overwrite": True, "progress": False, "device": args.get("device", "cpu")}
            summary = Trainer(TrainConfig.from_dict(values)).fit()
            train_s += summary["train_time_s"]
            losses[e.id] = _losses(work / "solo" / e.id)
        return {"wall_s": time.perf_counter() - t0, "train_s": train_s, "losses": losses,
                "threads": torch.get_num_threads()}
    if args["mode"] == "sweep":
        k = None if args["k"] == "auto" else int(args["k"])
        t0 = time.perf_counter()
        out = work / f"sweep-{args['k']}"
        board = run_sweep(SweepConfig(store=args["store"], model="gcn", grid=parse_grid(GRID), epochs=epochs,
                                      patience=epochs, batch_models=k, device=args.get("device", "cpu"), out=str(out),
                                      overwrite=True,
                                      progress=False))
        losses = {r["config"]: _losses(out / "configs" / r["config"]) for r in board["rows"]}
        return {"wall_s": time.perf_counter() - t0, "train_s": board["sweep_time_s"], "losses": losses,
                "k": board["batch_models"]["2"], "batches": len(board["batches"]),
                "choice": board["batch_choice"]["2"]["text"]}
    if args["mode"] == "breakdown":
        return _breakdown(args["store"], args["k"])
    if args["mode"] == "ab":
        return _ab(args["store"], args["k"], args.get("reps", 3), tuple(args.get("rewrites", DEFAULT)))
    raise ValueError(args["mode"])


CATEGORIES = {"aggregation": ("_SpMM", "_SpMMBackward"), "dense matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
              "dropout RNG": ("aten::bernoulli_",)}


def _categorize(prof: Any) -> dict[str, float]:
    out = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    for ev in prof.key_averages():
        cat = next((c for c, names in CATEGORIES.items() if ev.key in names), "other")
        out[cat] += ev.self_cpu_time_total / 1e6
    return out


def _epoch(model: Any, opts: list[Any], data: Any) -> None:
    """One training step and one evaluation pass of a solo or batched model (the sum of its losses)."""
    import torch

    g, x, y, idx = data.graph, data.x, data.y, data.splits["train"]
    model.train()
    for o in opts:
        o.zero_grad(set_to_none=True)
    out = model(g, x)
    outs = out if isinstance(out, list) else [out]
    torch.stack([data.task.loss(o[idx], y[idx]) for o in outs]).sum().backward()
    for o in opts:
        o.step()
    model.eval()
    with torch.no_grad():
        model(g, x)


def _breakdown(store: str, k: Any) -> dict[str, Any]:
    """Seconds per category of one epoch (after one warm-up epoch): all solo configurations vs batched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trellis.nn.batched import BatchedGNN
    from trellis.train.optim import build_optimizer
    from trellis.train.sweep import build_config_model, load_sweep_data

    entries = _configs(store)
    strategy = load_sweep_data(entries, torch.device("cpu"))  # the full-batch strategy a sweep trains on
    data = strategy.data

    def epoch(model: Any, opts: list[Any]) -> None:
        _epoch(model, opts, data)

    def measure(model: Any, opts: list[Any]) -> tuple[dict[str, float], float]:
        epoch(model, opts)  # warm-up: caches, kernels
        t = time.perf_counter()
        epoch(model, opts)
        wall = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            epoch(model, opts)
        return _categorize(prof), wall

    solo = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    solo_wall = 0.0
    for e in entries:
        model, _ = build_config_model(e, strategy, torch.device("cpu"))
        opt = build_optimizer(e.cfg.optimizer, model.parameters(), lr=e.cfg.lr, weight_decay=e.cfg.weight_decay)
        cats, wall = measure(model, [opt])
        solo_wall += wall
        for c, v in cats.items():
            solo[c] += v
    kk = len(entries) if k == "auto" else int(k)
    batched = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    batched_wall = 0.0
    for start in range(0, len(entries), kk):
        chunk = entries[start:start + kk]
        built = [build_config_model(e, strategy, torch.device("cpu")) for e in chunk]
        opts = [build_optimizer(e.cfg.optimizer, m.parameters(), lr=e.cfg.lr, weight_decay=e.cfg.weight_decay)
                for e, (m, _) in zip(chunk, built)]
        bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
        cats, wall = measure(bm, opts)
        batched_wall += wall
        for c, v in cats.items():
            batched[c] += v
    return {"solo": solo, "solo_epoch_s": solo_wall, "batched": batched, "batched_epoch_s": batched_wall, "k": kk}


DEFAULT = ("share_constant_aggregation", "fuse_elementwise")


def _ab(store: str, k: Any, reps: int, rewrites: tuple[str, ...]) -> dict[str, Any]:
    """Interleaved epochs: all 12 solo models one epoch each, then the batched model(s) one epoch; repeated.

    Why interleaved: on a shared machine the load drifts over minutes; alternating the two sides within
    seconds exposes both to the same conditions, and the medians compare like with like.
    """
    import statistics

    import torch

    from trellis.nn.batched import BatchedGNN
    from trellis.train.optim import build_optimizer
    from trellis.train.sweep import build_config_model, load_sweep_data

    entries = _configs(store)
    strategy = load_sweep_data(entries, torch.device("cpu"))  # the full-batch strategy a sweep trains on
    data = strategy.data

    def opt(e: Any, m: Any) -> Any:
        return build_optimizer(e.cfg.optimizer, m.parameters(), lr=e.cfg.lr, weight_decay=e.cfg.weight_decay)

    def epoch(model: Any, opts: list[Any]) -> None:
        _epoch(model, opts, data)

    solos = []
    for e in entries:
        m, _ = build_config_model(e, strategy, torch.device("cpu"))
        solos.append((m, [opt(e, m)]))
    kk = len(entries) if k == "auto" else int(k)
    batches = []
    for start in range(0, len(entries), kk):
        chunk = entries[start:start + kk]
        built = [build_config_model(e, strategy, torch.device("cpu")) for e in chunk]
        batches.append((BatchedGNN([m for m, _ in built], [q for _, q in built], rewrites=rewrites),
                        [opt(e, m) for e, (m, _) in zip(chunk, built)]))
    for m, o in solos + batches:  # warm-up
        epoch(m, o)
    ts, tb = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for m, o in solos:
            epoch(m, o)
        ts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for m, o in batches:
            epoch(m, o)
        tb.append(time.perf_counter() - t)
    return {"k": kk, "rewrites": list(rewrites), "solo_epoch_s": statistics.median(ts),
            "batched_epoch_s": statistics.median(tb), "solo_all": ts, "batched_all": tb,
            "speedup": statistics.median([s / b for s, b in zip(ts, tb)])}


def _cli_baseline(store: str, work: Path, epochs: int) -> dict[str, Any]:
    """Twelve ``trellis train`` processes, one after another (interpreter start and data load included)."""
    entries = _configs(store)
    t0 = time.perf_counter()
    losses = {}
    for e in entries:
        out = work / "cli" / e.id
        cfg_file = work / "cli" / f"{e.id}.json"
        cfg_file.parent.mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(json.dumps({**e.cfg.to_dict(), "epochs": epochs, "patience": epochs, "device": "cpu"}))
        subprocess.run([sys.executable, "-m", "trellis.cli.main", "train", "--config", str(cfg_file), "--out", str(out),
                        "--overwrite", "--no-progress"], check=True, capture_output=True,
                       cwd=Path(__file__).resolve().parents[1])
        losses[e.id] = _losses(out)
    return {"wall_s": time.perf_counter() - t0, "losses": losses}


def _max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(a[c], b[c])) for c in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child")
    p.add_argument("--graphs", default="sbm-100k,amazon-computers")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--ks", default="auto,1,4,12", help="batch sizes to run (auto = the planner's choice)")
    p.add_argument("--cli-baseline", action="store_true", help="also time 12 `trellis train` processes")
    p.add_argument("--breakdown", action="store_true", help="profile one epoch per category")
    p.add_argument("--ab", default="", help="interleaved per-epoch A/B at these K (e.g. 12,4); each also "
                                            "without rewrites (batching alone)")
    p.add_argument("--only-ab", action="store_true", help="run only the interleaved A/B")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the interleaved A/B (default: 3)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda (solo and batched runs; breakdown/A-B stay on CPU)")
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    rows, breakdowns, abs_ = [], [], []
    for name in a.graphs.split(","):
        store = graph_store(name)
        work = Path(tempfile.mkdtemp(prefix=f"bench-sweep-{name}-"))
        for k in [k for k in a.ab.split(",") if k]:
            for rw in (list(DEFAULT), []):
                res = run_isolated("benchmarks.bench_sweep", {"mode": "ab", "store": store, "k": k, "rewrites": rw,
                                                              "work": str(work), "epochs": a.epochs,
                                                              "reps": a.reps})
                res.update(graph=name, load_avg=os.getloadavg()[0])
                abs_.append(res)
                print(json.dumps(res), flush=True)
        if a.only_ab:
            shutil.rmtree(work, ignore_errors=True)
            continue
        try:
            load = os.getloadavg()[0]
            solo = run_isolated("benchmarks.bench_sweep", {"mode": "solo", "store": store, "epochs": a.epochs,
                                                           "work": str(work), "device": a.device})
            if "error" in solo:
                raise SystemExit(f"{name} solo: {solo['error']}")
            row = {"graph": name, "epochs": a.epochs, "solo_train_s": solo["train_s"], "solo_wall_s": solo["wall_s"],
                   "load_avg": load}
            if a.cli_baseline:
                cli = _cli_baseline(store, work, a.epochs)
                row["cli_wall_s"] = cli["wall_s"]
            for k in a.ks.split(","):
                res = run_isolated("benchmarks.bench_sweep", {"mode": "sweep", "store": store, "epochs": a.epochs,
                                                              "work": str(work), "k": k, "device": a.device})
                if "error" in res:
                    row[f"K={k}"] = res["error"]
                    continue
                tag = f"K={res['k']}" + (" (auto)" if k == "auto" else "")
                rows.append({**row, "batched": tag, "batches": res["batches"], "sweep_train_s": res["train_s"],
                             "sweep_wall_s": res["wall_s"], "speedup_train": solo["train_s"] / res["train_s"],
                             "speedup_wall": solo["wall_s"] / res["wall_s"],
                             **({"speedup_vs_cli": row["cli_wall_s"] / res["wall_s"]} if a.cli_baseline else {}),
                             "max_loss_diff": _max_diff(solo["losses"], res["losses"])})
                if k == "auto":
                    print(res["choice"], file=sys.stderr)
                print(json.dumps(rows[-1]), flush=True)
            if a.breakdown:
                bd = run_isolated("benchmarks.bench_sweep", {"mode": "breakdown", "store": store, "k": "auto",
                                                             "work": str(work), "epochs": a.epochs})
                bd["graph"] = name
                breakdowns.append(bd)
                print(json.dumps(bd), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if abs_:
        print_table([{"graph": r["graph"], "K": r.get("k"), "rewrites": "+".join(r.get("rewrites", [])) or "none",
                      "solo_epoch_s": r.get("solo_epoch_s", r.get("error")),
                      "batched_epoch_s": r.get("batched_epoch_s"), "speedup": r.get("speedup"),
                      "load_avg": r["load_avg"]} for r in abs_],
                    ["graph", "K", "rewrites", "solo_epoch_s", "batched_epoch_s", "speedup", "load_avg"])
    if not rows:
        return
    cols = ["graph", "epochs", "batched", "batches", "solo_train_s", "sweep_train_s", "speedup_train", "solo_wall_s",
            "sweep_wall_s", "speedup_wall", "max_loss_diff", "load_avg"]
    if a.cli_baseline:
        cols += ["cli_wall_s", "speedup_vs_cli"]
    print_table(rows, cols)
    if breakdowns:
        brows = []
        for bd in breakdowns:
            for c in [*CATEGORIES, "other"]:
                s, b = bd["solo"][c], bd["batched"][c]
                brows.append({"graph": bd["graph"], "part": c, "solo_12_configs_s": s,
                              f"batched_K{bd['k']}_s": b, "ratio": s / b if b else float("nan")})
            brows.append({"graph": bd["graph"], "part": "epoch wall", "solo_12_configs_s": bd["solo_epoch_s"],
                          f"batched_K{bd['k']}_s": bd["batched_epoch_s"],
                          "ratio": bd["solo_epoch_s"] / bd["batched_epoch_s"]})
        print_table(brows, list(brows[0]))
    if a.json:
        print(json.dumps({"rows": rows, "breakdown": breakdowns, "ab": abs_}))


if __name__ == "__main__":
    main()
