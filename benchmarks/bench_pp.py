"""Pre-propagation data pipeline: naive DataLoader vs index assembly, prefetch, chunks, storage (PP-GNN §6.3).

    python -m benchmarks.bench_pp [speed] [--nodes 1250000] [--features 128] [--hops 3] [--batch-size 8192]
                                  [--epochs 3] [--models sgc,sign] [--hidden 64] [--work DIR] [--json FILE]
    python -m benchmarks.bench_pp accuracy [--datasets cora,amazon-computers,coauthor-cs] [--runs 10]
                                           [--batch-size 32] [--hidden 64]

``speed``: a generated planted-partition graph (``trellis.data.generate.generate_sbm``) with 80% of the
nodes in the training split (>= 1M training rows), preprocessed once with ``sym`` and R hops (timed, in its
own process). Then, for each model and loader mode, a separate process (so peak-memory figures are its
own) trains ``--epochs`` epochs and reports the median training-only epoch time (first epoch excluded), the
loader-only epoch time (iterating batches without a model), peak RssAnon and peak RSS, and ``/proc/self/io``
read_bytes; the sweep is repeated ``--rounds`` times and medians over rounds are reported (other processes'
load on a shared machine drifts over minutes):

    (a)  naive        torch DataLoader over a TensorDataset (per-row __getitem__ + collate)
    (a') naive-batch  the same DataLoader fed whole index batches by a BatchSampler (NOTES #5)
    (b)  index        one index_select per batch into a reused buffer
    (c)  prefetch     (b) + background double-buffered assembly
    (d)  chunk        (c) + chunk reshuffling, chunk = batch size (a batch is a zero-copy slice)
    (e)  storage      chunk reads with preadv from the hop files, page cache dropped before every epoch
                      (POSIX_FADV_DONTNEED), memory budget = 1/4 of the preprocessed size

Ratios are epoch-time speedups over (a) and (a'). Beside them: preprocessing time and one training run's
time (a real ``trellis train --strategy pp`` run through the trainer, with early stopping and auto
placement), as in PP-GNN appendix G.

``accuracy``: SIGN (R = 3) on the real datasets in ``../shared/data`` over ``--runs`` seeds, with exact
reshuffling and with chunk reshuffling (chunk = batch size), reported as mean ± std (sample std, the
trainer's summary) test accuracy at the best validation epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("naive", "naive-batch", "index", "prefetch", "chunk", "storage")
LABELS = {"naive": "(a) naive DataLoader", "naive-batch": "(a') DataLoader+BatchSampler", "index": "(b) index",
          "prefetch": "(c) +prefetch", "chunk": "(d) +chunk reshuffle", "storage": "(e) storage-backed"}


def _child(argv: list[str], timeout: float = 3600) -> dict[str, Any]:
    """Run ``python -m benchmarks.bench_pp <argv>`` in a fresh process and parse its last stdout line."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_pp", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# children
# ---------------------------------------------------------------------------------------------------


def child_preprocess(a: argparse.Namespace) -> dict[str, Any]:
    from trellis.loader.ppcache import PPSettings, ensure_pp
    from trellis.ops.propagate import OperatorSpec
    from trellis.utils.memory import PeakMemory, proc_io

    shutil.rmtree(a.pp, ignore_errors=True)  # always time a real build
    io0 = proc_io()
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        cache, action = ensure_pp(a.store, a.pp, PPSettings(OperatorSpec("sym"), hops=a.hops), overwrite=True,
                                  progress=False, log=None)
    return {"seconds": time.perf_counter() - t0, "action": action, "bytes": cache.nbytes(),
            "peak_rss_anon": mem.peak_anon, "peak_rss": mem.peak_rss,
            "write_bytes": proc_io().get("write_bytes", 0) - io0.get("write_bytes", 0)}


def child_epoch(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from trellis.loader.pp import PPData, StorageSource, plan_placement
    from trellis.loader.ppcache import open_pp
    from trellis.nn.pp_models import build_pp_model, hops_used
    from trellis.utils.memory import PeakMemory, proc_io

    if a.threads:
        torch.set_num_threads(a.threads)
    cache = open_pp(a.pp)
    hops = hops_used(a.model, cache.hops)
    budget = a.budget if a.budget else None
    chunk = a.batch_size if a.mode in ("chunk", "storage") else None
    with PeakMemory(interval=0.005) as mem:
        pl = plan_placement(cache, hops, a.batch_size, loader=a.mode, chunk_size=chunk, memory_budget=budget)
        data = PPData(cache, hops, pl, a.batch_size)
        storage = isinstance(data.source, StorageSource)
        torch.manual_seed(0)
        model = build_pp_model(a.model, cache.num_features, cache.hops, cache.num_classes or 2, hidden=a.hidden,
                               dropout=0.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        epoch_s, load_s, reads = [], [], []
        for ep in range(a.epochs):
            data.train.set_epoch(ep)
            if storage:
                data.source.drop_cache()
            io0 = proc_io()
            t0 = time.perf_counter()
            for x, y in data.train:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            epoch_s.append(time.perf_counter() - t0)
            reads.append(proc_io().get("read_bytes", 0) - io0.get("read_bytes", 0))
        for ep in range(a.load_epochs):  # the loader alone: what the model would wait for without overlap
            data.train.set_epoch(100 + ep)
            if storage:
                data.source.drop_cache()
            t0 = time.perf_counter()
            for _batch in data.train:
                pass
            load_s.append(time.perf_counter() - t0)
        data.close()
    warm = epoch_s[1:] if len(epoch_s) > 1 else epoch_s
    return {"model": a.model, "mode": a.mode, "placement": pl.to_dict(), "epoch_s": epoch_s,
            "epoch_median_s": statistics.median(warm), "epoch_min_s": min(warm),
            "loader_only_s": statistics.median(load_s) if load_s else None,
            "loader_only_min_s": min(load_s) if load_s else None,
            "read_bytes_per_epoch": statistics.median(reads), "peak_rss_anon": mem.peak_anon, "peak_rss": mem.peak_rss,
            "batches": len(data.train), "threads": torch.get_num_threads()}


def child_train(a: argparse.Namespace) -> dict[str, Any]:
    """One real pre-propagation training run through the trainer (``trellis train --strategy pp``)."""
    import torch

    from trellis.train.config import TrainConfig
    from trellis.train.trainer import Trainer
    from trellis.utils.memory import PeakMemory

    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench-pp-run-") as out:
        # Adam, selection on validation accuracy, CPU: what this benchmark's training runs have always used.
        cfg = TrainConfig(store=a.store, strategy="pp", pp_dir=a.pp, model=a.model, hidden=a.hidden,
                          epochs=a.epochs, patience=a.patience, batch_size=a.batch_size, lr=a.lr,
                          dropout=a.dropout, weight_decay=a.weight_decay, runs=a.runs, seed=a.seed,
                          pp_loader=a.mode, chunk_size=a.chunk_size, model_args={"input_dropout": a.input_dropout},
                          optimizer="adam", metric="acc", device="cpu", out=out, overwrite=True, progress=False,
                          checkpoint_every=0)
        t0 = time.perf_counter()
        with PeakMemory() as mem:  # the whole run: opening the cache, loading the rows, every epoch
            s = Trainer(cfg).fit()
        run_time = time.perf_counter() - t0
    return {"test_acc_mean": s["test_acc_mean"], "test_acc_std": s["test_acc_std"], "val_acc_mean": s["val_acc_mean"],
            "epoch_time_s_median": s["epoch_time_s_median"], "epochs_total": s["steps_timed"],
            "step_time_s": s["epoch_time_s_mean"] * s["steps_timed"], "train_time_s": s["train_time_s"],
            "run_time_s": run_time, "load_time_s": s["load_time_s"], "peak_rss_anon_mb": mem.peak_anon / 2**20,
            "peak_rss_mb": mem.peak_rss / 2**20, "runs": s["runs"], "loader": s["loader"],
            "placement": s["placement"]}


# ---------------------------------------------------------------------------------------------------
# speed
# ---------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def run_speed(a: argparse.Namespace) -> dict[str, Any]:
    from trellis.data.generate import generate_sbm
    from trellis.data.store import open_store

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    store = work / f"sbm-{a.nodes}-f{a.features}"
    if not (store / "manifest.json").exists():
        t0 = time.perf_counter()
        generate_sbm(store, nodes=a.nodes, avg_degree=a.avg_degree, features=a.features, classes=a.classes,
                     train_frac=0.8, val_frac=0.1, seed=0, progress=False)
        print(f"generated {store} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    st = open_store(store, verify=False)
    n_train = int(st.split("train").shape[0])
    pp = work / f"pp-sym-R{a.hops}"
    if a.reuse and (pp / "COMPLETE").exists():  # keep an earlier build; report its recorded build time
        from trellis.loader.ppcache import open_pp

        c = open_pp(pp)
        pre = {"seconds": c.manifest["build"]["seconds"], "action": "reused", "bytes": c.nbytes(),
               "peak_rss_anon": 0, "peak_rss": 0, "write_bytes": 0}
    else:
        pre = _child(["_preprocess", "--store", str(store), "--pp", str(pp), "--hops", str(a.hops)])
    print(f"preprocess: {pre['seconds']:.1f} s, {_gib(pre['bytes'])}, peak RssAnon {_mib(pre['peak_rss_anon'])}",
          file=sys.stderr)
    budget = pre["bytes"] // 4
    rounds: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rnd in range(a.rounds):  # whole sweeps repeated: load from other processes drifts over minutes
        for model in a.models.split(","):
            for mode in a.modes.split(","):
                argv = ["_epoch", "--pp", str(pp), "--model", model, "--mode", mode, "--batch-size",
                        str(a.batch_size), "--epochs", str(a.epochs), "--hidden", str(a.hidden), "--threads",
                        str(a.threads), "--load-epochs", str(a.load_epochs)]
                if mode == "storage":
                    argv += ["--budget", str(budget)]
                r = _child(argv)
                r["loadavg"] = os.getloadavg()[0]
                rounds.setdefault((model, mode), []).append(r)
                print(f"round {rnd} {model:5s} {LABELS[mode]:30s} epoch {r['epoch_median_s']:7.3f} s  loader-only "
                      f"{r['loader_only_s'] or 0:7.3f} s  RssAnon {_mib(r['peak_rss_anon']):>9s}  RSS "
                      f"{_mib(r['peak_rss']):>9s}  read/epoch {_mib(r['read_bytes_per_epoch']):>9s}  "
                      f"load {r['loadavg']:.1f}", file=sys.stderr)
    results = [_merge_rounds(rs) for rs in rounds.values()]
    train = None
    if a.train_run:
        train = _child(["_train", "--store", str(store), "--pp", str(pp), "--model", "sign", "--hidden",
                        str(a.hidden), "--epochs", str(a.train_epochs), "--patience", "5", "--batch-size",
                        str(a.batch_size), "--threads", str(a.threads), "--mode", "auto"])
        print(f"training run (sign, auto): {train['run_time_s']:.1f} s, {train['epochs_total']} epochs, "
              f"test {train['test_acc_mean'] * 100:.2f}", file=sys.stderr)
    return {"nodes": a.nodes, "edges": st.num_edges, "train_rows": n_train, "features": a.features, "hops": a.hops,
            "batch_size": a.batch_size, "hidden": a.hidden, "preprocess": pre, "budget_storage": budget,
            "results": results, "train_run": train, "machine": _machine()}


def _merge_rounds(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per (model, mode): median over rounds of each round's median; min over all epochs."""
    out = dict(rs[0])
    for key in ("epoch_median_s", "loader_only_s", "read_bytes_per_epoch"):
        out[key] = statistics.median(r[key] for r in rs)
    out["epoch_min_s"] = min(r["epoch_min_s"] for r in rs)
    for key in ("peak_rss_anon", "peak_rss"):
        out[key] = max(r[key] for r in rs)
    out["rounds"] = [{k: r[k] for k in ("epoch_s", "loader_only_s", "loadavg")} for r in rs]
    return out


def _machine() -> dict[str, Any]:
    import psutil
    import torch

    return {"cpus": os.cpu_count(), "ram": psutil.virtual_memory().total, "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_at_end": os.getloadavg()}


def print_speed(rep: dict[str, Any]) -> None:
    print(f"\n## SGC/SIGN epoch time by loader — {rep['train_rows']:,} training rows, {rep['hops']} hops, "
          f"{rep['features']} features, batch {rep['batch_size']}, SIGN hidden {rep['hidden']}\n")
    print("| model | loader | epoch median (min) s | loader only (s) | vs (a) | vs (a') | peak RssAnon | peak RSS | "
          "read/epoch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    half = rep["preprocess"]["bytes"] / 2
    for model in dict.fromkeys(r["model"] for r in rep["results"]):
        rows = {r["mode"]: r for r in rep["results"] if r["model"] == model}
        a0 = rows.get("naive", {}).get("epoch_median_s")
        a1 = rows.get("naive-batch", {}).get("epoch_median_s")
        for mode, r in rows.items():
            t = r["epoch_median_s"]
            va = f"{a0 / t:.1f}×" if a0 else "–"
            vb = f"{a1 / t:.1f}×" if a1 else "–"
            print(f"| {model} | {LABELS[mode]} | {t:.3f} ({r.get('epoch_min_s', t):.3f}) | {r['loader_only_s']:.3f} | "
                  f"{va} | {vb} | {_mib(r['peak_rss_anon'])} | {_mib(r['peak_rss'])} | "
                  f"{_mib(r['read_bytes_per_epoch'])} |")
        if "chunk" in rows and "storage" in rows:
            d, e = rows["chunk"], rows["storage"]
            print(f"\n{model}: storage-backed throughput = {d['epoch_median_s'] / e['epoch_median_s']:.2f}× of (d); "
                  f"its peak RSS {_mib(e['peak_rss'])} vs half the preprocessed data {_mib(half)}\n")
    pre = rep["preprocess"]
    print(f"preprocessing (sym, R={rep['hops']}, {rep['nodes']:,} nodes, {rep['edges']:,} edges): "
          f"{pre['seconds']:.1f} s, output {_gib(pre['bytes'])}, peak RssAnon {_mib(pre['peak_rss_anon'])}; "
          f"storage budget {_gib(rep['budget_storage'])}")
    if rep.get("train_run"):
        t = rep["train_run"]
        t.setdefault("epoch_time_s_median", t.get("epoch_time_median_s"))  # reports saved before the one trainer
        print(f"one training run (SIGN, auto placement, early stopping): {t['run_time_s']:.1f} s "
              f"({t['epochs_total']} epochs, median epoch {t['epoch_time_s_median']:.2f} s, test acc "
              f"{t['test_acc_mean'] * 100:.2f}%); preprocessing / run = {pre['seconds'] / t['run_time_s']:.2f}")
    m = rep["machine"]
    print(f"\nmachine: {m['cpus']} CPUs, {m['ram'] / 2**30:.0f} GiB RAM, torch {m['torch']}, "
          f"load average at the end {m['loadavg_at_end']}")


# ---------------------------------------------------------------------------------------------------
# accuracy
# ---------------------------------------------------------------------------------------------------

DATASETS = {"cora": "cora", "amazon-computers": "amazon-computers", "coauthor-cs": "coauthor-cs"}


def run_accuracy(a: argparse.Namespace) -> dict[str, Any]:
    from trellis.data.importers import import_graph

    data_dir = Path(a.data_dir)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"runs": a.runs, "results": []}
    for name in a.datasets.split(","):
        store = work / f"store-{name}"
        if not (store / "manifest.json").exists():
            import_graph(data_dir / DATASETS[name], store, progress=False)
        pp = work / f"pp-{name}-sym-R{a.hops}"
        pre = _child(["_preprocess", "--store", str(store), "--pp", str(pp), "--hops", str(a.hops)])
        for label, mode, chunk in (("exact", "auto", None), ("chunk=batch", "chunk", a.batch_size)):
            argv = ["_train", "--store", str(store), "--pp", str(pp), "--model", "sign", "--hidden", str(a.hidden),
                    "--epochs", str(a.epochs), "--patience", str(a.patience), "--batch-size", str(a.batch_size),
                    "--runs", str(a.runs), "--lr", str(a.lr), "--dropout", str(a.dropout), "--mode", mode,
                    "--threads", str(a.threads), "--weight-decay", str(a.weight_decay),
                    "--input-dropout", str(a.input_dropout)]
            if chunk:
                argv += ["--chunk-size", str(chunk)]
            r = _child(argv)
            r.update({"dataset": name, "reshuffling": label, "preprocess_s": pre["seconds"]})
            out["results"].append(r)
            print(f"{name:18s} {label:12s} test {r['test_acc_mean'] * 100:.2f} ± {r['test_acc_std'] * 100:.2f} "
                  f"(val {r['val_acc_mean'] * 100:.2f}); run {r['run_time_s']:.1f} s; "
                  f"preprocess {pre['seconds']:.2f} s", file=sys.stderr)
    return out


def print_accuracy(rep: dict[str, Any]) -> None:
    print(f"\n## SIGN test accuracy, {rep['runs']} seeds (mean ± std at best validation epoch)\n")
    print("| dataset | reshuffling | test acc (%) | val acc (%) | run time (s) | preprocessing (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rep["results"]:
        print(f"| {r['dataset']} | {r['reshuffling']} | {r['test_acc_mean'] * 100:.2f} ± {r['test_acc_std'] * 100:.2f}"
              f" | {r['val_acc_mean'] * 100:.2f} | {r['run_time_s']:.1f} | {r['preprocess_s']:.2f} |")


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and not argv[0].startswith("-") else "speed"
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.bench_pp {cmd}")
    tmp = Path(tempfile.gettempdir())
    p.add_argument("--work", default=str(tmp / "trellis-bench-pp"))
    p.add_argument("--json", default=None, help="also write the full report here")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--hops", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=64)
    if cmd == "speed":
        p.add_argument("--nodes", type=int, default=1_250_000)
        p.add_argument("--avg-degree", type=float, default=10.0)
        p.add_argument("--features", type=int, default=128)
        p.add_argument("--classes", type=int, default=8)
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--load-epochs", type=int, default=1)
        p.add_argument("--models", default="sgc,sign")
        p.add_argument("--modes", default=",".join(MODES))
        p.add_argument("--train-run", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--train-epochs", type=int, default=30)
        p.add_argument("--reuse", action="store_true", help="reuse an existing preprocessed cache in --work")
        p.add_argument("--rounds", type=int, default=2, help="repeat the sweep; medians over rounds")
        a = p.parse_args(argv)
        rep = run_speed(a)
        print_speed(rep)
    elif cmd == "accuracy":
        p.add_argument("--datasets", default="cora,amazon-computers,coauthor-cs")
        p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
        p.add_argument("--runs", type=int, default=10)
        p.add_argument("--epochs", type=int, default=200)
        p.add_argument("--patience", type=int, default=50)
        p.add_argument("--lr", type=float, default=0.01)
        # chosen on Cora's validation accuracy (3 seeds each; dropout/input dropout 0.5-0.7, 1-2 MLP layers)
        p.add_argument("--dropout", type=float, default=0.7)
        p.add_argument("--input-dropout", type=float, default=0.7)
        p.add_argument("--weight-decay", type=float, default=5e-4)
        p.set_defaults(batch_size=32)  # a few batches per epoch on 140-300 training nodes
        a = p.parse_args(argv)
        rep = run_accuracy(a)
        print_accuracy(rep)
    elif cmd == "report":  # re-print a saved report: python -m benchmarks.bench_pp report FILE
        rep = json.loads(Path(argv[0]).read_text())
        (print_speed if "results" in rep and "train_rows" in rep else print_accuracy)(rep)
        return 0
    elif cmd in ("_preprocess", "_epoch", "_train"):
        p.add_argument("--store")
        p.add_argument("--pp")
        p.add_argument("--model", default="sign")
        p.add_argument("--mode", default="auto")
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--load-epochs", type=int, default=1)
        p.add_argument("--budget", type=int, default=0)
        p.add_argument("--patience", type=int, default=5)
        p.add_argument("--runs", type=int, default=1)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--lr", type=float, default=0.01)
        p.add_argument("--dropout", type=float, default=0.5)
        p.add_argument("--input-dropout", type=float, default=0.0)
        p.add_argument("--weight-decay", type=float, default=0.0)
        p.add_argument("--chunk-size", type=int, default=None)
        a = p.parse_args(argv)
        fn = {"_preprocess": child_preprocess, "_epoch": child_epoch, "_train": child_train}[cmd]
        print(json.dumps(fn(a), default=str))
        return 0
    else:
        p.error(f"unknown command {cmd!r}; use speed or accuracy")
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
