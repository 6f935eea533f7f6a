"""Training pre-propagation models (SGC, SIGN, HOGA) from a ``PP_DIR`` — the ``pp`` strategy.

Why a loop of its own: after preprocessing there is no graph left to train on, only dense rows, and the
epoch time is dominated by data loading (PP-GNN §3.3), so the loop is built around a placement-chosen
loader (:mod:`trellis.loader.pp`) and measures what matters: the training-only epoch time (evaluation is
timed apart), the peak anonymous memory (``RssAnon``: mapped file pages are the page cache's, NOTES
"Everywhere") beside the peak RSS, and the bytes read from storage.

``train_pp(store, pp_dir, config)`` runs ``config.runs`` seeds with early stopping on validation accuracy,
reports the test accuracy at the best validation epoch, and writes ``config.json``, ``metrics.jsonl``
and ``summary.json`` to ``config.out`` when given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.data.store import GraphStore, open_store
from trellis.errors import TrellisUserError
from trellis.loader.pp import LOADERS, PPData, fmt_bytes, plan_placement
from trellis.loader.ppcache import PPCache, open_pp
from trellis.nn.pp_models import PP_MODELS, PPModel, build_pp_model, hops_used
from trellis.train.convergence import summarize_time_to_accuracy

#: ``format`` of a pre-propagation model file (``RUN_DIR/models/run-N.pt``; read by ``trellis predict``).
PP_MODEL_FORMAT = "trellis-pp-model"


@torch.no_grad()
def predict_pp(saved: dict[str, Any], store: GraphStore, device: torch.device,
               batch_rows: int = 65536) -> Tensor:
    """Logits ``[N, C]`` of every node of ``store`` from a saved pre-propagation model and its cache.

    Raises:
        TrellisUserError: The cache is gone, was built from another store, or keeps only split rows.
    """
    cache = open_pp(saved["pp_dir"])
    cache.check_store(store)
    if cache.split_rows_only:
        raise TrellisUserError(
            f"{cache.path}: built with --split-rows-only, so it holds only train/val/test rows; predicting every "
            "node needs all rows: `trellis preprocess STORE --all-rows --out PP_DIR --overwrite`")
    model = build_pp_model(saved["model"], saved["num_features"], saved["hops"], saved["num_classes"],
                           **saved["kwargs"])
    model.load_state_dict(saved["state_dict"])
    model.to(device).eval()
    hops = hops_used(saved["model"], cache.hops)
    arrays = [cache.hop(r) for r in hops]
    rows = cache.rows
    out = torch.empty((store.num_nodes, saved["num_classes"]), dtype=torch.float32, device=device)
    for a in range(0, cache.num_rows, batch_rows):
        b = min(a + batch_rows, cache.num_rows)
        x = torch.from_numpy(np.stack([arr[a:b] for arr in arrays], axis=1)).to(device)
        out[torch.from_numpy(np.array(rows[a:b], dtype=np.int64)).to(device)] = model(x).float()
    return out


# ---------------------------------------------------------------------------------------------------
# process memory and I/O
# ---------------------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process in bytes (``/proc/self/status``)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux: fall back to psutil's RSS
        import psutil

        rss = psutil.Process().memory_info().rss
        out = {"VmRSS": rss, "VmHWM": rss, "RssAnon": rss, "RssFile": 0}
    return out


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` counters (``read_bytes`` = bytes fetched from storage); empty where absent."""
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return {}


class PeakMemory:
    """Samples ``RssAnon`` and ``VmRSS`` in a background thread and keeps the peaks.

    Why sample: the kernel tracks the peak total RSS (``VmHWM``) but not the peak of anonymous memory.
    A 10 ms period catches batch-sized allocations; ``VmHWM`` is read too, as the exact peak RSS.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak_anon = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trellis-peak-memory", daemon=True)

    def _sample(self) -> None:
        s = proc_status()
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", 0))
        self.peak_rss = max(self.peak_rss, s.get("VmRSS", 0), s.get("VmHWM", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------


@dataclass
class PPTrainConfig:
    """Hyperparameters and loader settings of a pre-propagation training run.

    Attributes:
        model: ``sgc``, ``sign`` or ``hoga`` (default: sign).
        hidden: Hidden width (default: 256).
        layers: Layers of the output MLP (default: 2).
        heads: HOGA attention heads (default: 4).
        dropout: Dropout (default: 0.5).
        input_dropout: Dropout on the input features (default: 0).
        lr: Adam learning rate (default: 0.01).
        weight_decay: Adam weight decay (default: 0).
        epochs: Maximum epochs per run (default: 200).
        patience: Stop after this many epochs without a better validation accuracy; 0 = never (default: 50).
        batch_size: Training batch size (default: 8192, PP-GNN's).
        eval_batch_size: Evaluation batch size (default: max(batch size, 8192)).
        chunk_size: Chunk reshuffling chunk (1 = exact reshuffling; default: chosen by the placement).
        memory_budget: Bytes or a size like ``4G`` (default: 80% of available RAM).
        loader: One of :data:`trellis.loader.pp.LOADERS` (default: auto).
        runs: Seeds to run (default: 1).
        seed: First seed; run ``r`` uses ``seed + r`` (default: 0).
        device: Torch device (default: cpu).
        threads: Torch intra-op threads (default: torch's choice).
        out: Run directory for config.json / metrics.jsonl / summary.json (default: none).
        target_acc: Validation accuracy in (0, 1] whose time and epochs to reach the summary reports
            (default: none; see :mod:`trellis.train.convergence`).
    """

    model: str = "sign"
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    dropout: float = 0.5
    input_dropout: float = 0.0
    lr: float = 0.01
    weight_decay: float = 0.0
    epochs: int = 200
    patience: int = 50
    batch_size: int = 8192
    eval_batch_size: int | None = None
    chunk_size: int | None = None
    memory_budget: int | str | None = None
    loader: str = "auto"
    runs: int = 1
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    out: str | None = None
    target_acc: float | None = None

    def __post_init__(self) -> None:
        if self.model not in PP_MODELS:
            raise TrellisUserError(f"unknown --model {self.model!r}; use one of {', '.join(PP_MODELS)}")
        if self.loader not in LOADERS:
            raise TrellisUserError(f"unknown --loader {self.loader!r}; use one of {', '.join(LOADERS)}")
        for name in ("hidden", "layers", "heads", "epochs", "batch_size", "runs"):
            if int(getattr(self, name)) < 1:
                raise TrellisUserError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.patience < 0:
            raise TrellisUserError("--patience must be >= 0 (0 = no early stopping)")
        if not 0.0 <= self.dropout < 1.0 or not 0.0 <= self.input_dropout < 1.0:
            raise TrellisUserError("dropout must be in [0, 1)")
        if self.lr <= 0:
            raise TrellisUserError(f"--lr {self.lr} must be > 0")
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:
            raise TrellisUserError(f"--target-acc must be in (0, 1] (got {self.target_acc})")


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------


def _accuracy(model: PPModel, batches: Any, device: torch.device) -> tuple[float, int]:
    correct = 0
    total = 0
    model.eval()
    with torch.inference_mode():
        for x, y in batches:
            pred = model(x.to(device, non_blocking=True)).argmax(dim=1).cpu()
            mask = y >= 0
            correct += int((pred[mask] == y[mask]).sum())
            total += int(mask.sum())
    return (correct / total if total else float("nan")), total


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def train_pp(store: GraphStore | str | os.PathLike[str], pp_dir: PPCache | str | os.PathLike[str],
             config: PPTrainConfig | None = None, *, log: Callable[[str], None] | None = print,
             **overrides: Any) -> dict[str, Any]:
    """Train a pre-propagation model for ``config.runs`` seeds and return the summary.

    Args:
        store: The graph store the cache was built from (checked by content checksum).
        pp_dir: The cache (``trellis preprocess`` output) or an opened :class:`PPCache`.
        config: Settings (default: :class:`PPTrainConfig` defaults).
        log: Where progress lines go (None = silent).
        **overrides: Fields of :class:`PPTrainConfig` to override.

    Returns:
        The summary dict (also written to ``summary.json`` when ``config.out`` is set): per-run best
        validation / test accuracy and epochs, their means and standard deviations, the median
        training-only epoch time, peak RSS and RssAnon, bytes read from storage, the placement, and the
        preprocessing time recorded in the cache.
    """
    cfg = dataclasses.replace(config or PPTrainConfig(), **overrides) if overrides else (config or PPTrainConfig())
    t_start = time.perf_counter()
    if not isinstance(store, GraphStore):
        store = open_store(store)
    cache = pp_dir if isinstance(pp_dir, PPCache) else open_pp(pp_dir)
    cache.check_store(store)
    if cache.task not in ("multiclass", "binary", None) or cache.y is None:
        raise TrellisUserError(
            f"{store.path}: the pp strategy trains multiclass/binary node classification; this store's task is "
            f"{cache.task!r}{' without labels' if cache.y is None else ''}"
        )
    num_classes = cache.num_classes or int(np.max(cache.y)) + 1
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    device = torch.device(cfg.device)
    hops = hops_used(cfg.model, cache.hops)
    placement = plan_placement(cache, hops, cfg.batch_size, loader=cfg.loader, chunk_size=cfg.chunk_size,
                               memory_budget=cfg.memory_budget, device=device)
    if log:
        log(placement.describe())
    out = Path(cfg.out) if cfg.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(out / "config.json", {**asdict(cfg), "strategy": "pp", "store": str(store.path),
                                                 "pp_dir": str(cache.path), "placement": placement.to_dict()})
        (out / "metrics.jsonl").write_text("")
    io0 = proc_io()
    runs: list[dict[str, Any]] = []
    epoch_times: list[float] = []
    records: list[dict[str, Any]] = []  # every epoch's metrics line, for the time-to-accuracy fields
    with PeakMemory() as mem:
        t_load = time.perf_counter()
        data = PPData(cache, hops, placement, cfg.batch_size, seed=cfg.seed, eval_batch_size=cfg.eval_batch_size)
        load_s = time.perf_counter() - t_load
        try:
            for run in range(cfg.runs):
                runs.append(_one_run(cfg, run, data, cache, num_classes, device, epoch_times, out, log, records))
        finally:
            data.close()
    io1 = proc_io()
    tests = [r["test_acc"] for r in runs]
    vals = [r["best_val_acc"] for r in runs]
    summary: dict[str, Any] = {
        "status": "complete",
        "best_run": max(range(len(runs)), key=lambda i: runs[i]["best_val_acc"]),
        "strategy": "pp",
        "metric": "acc",
        "seeds": [r["seed"] for r in runs],
        "model": cfg.model,
        "store": str(store.path),
        "dataset": store.name,
        "pp_dir": str(cache.path),
        "operator": cache.manifest["settings"],
        "hops_used": list(hops),
        "placement": placement.to_dict(),
        "loader": data.train.describe(),
        "runs": runs,
        "test_acc_mean": _mean(tests),
        "test_acc_std": _std(tests),
        "val_acc_mean": _mean(vals),
        "val_acc_std": _std(vals),
        "epoch_time_median_s": statistics.median(epoch_times) if epoch_times else float("nan"),
        "epoch_time_s_median": statistics.median(epoch_times) if epoch_times else float("nan"),
        "steps_timed": len(epoch_times),
        "epochs_total": len(epoch_times),
        "train_time_s": sum(epoch_times),
        "load_time_s": load_s,
        "run_time_s": time.perf_counter() - t_start,
        "preprocess_seconds": cache.manifest.get("build", {}).get("seconds"),
        "peak_rss_bytes": mem.peak_rss,
        "peak_rss_anon_bytes": mem.peak_anon,
        "peak_rss_mb": mem.peak_rss / 2**20,
        "peak_rss_anon_mb": mem.peak_anon / 2**20,
        "device": str(device),
        "run_dir": str(out) if out is not None else None,
        "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
    }
    summary.update(summarize_time_to_accuracy(records, "acc", cfg.target_acc))
    if log:
        log(f"test acc {summary['test_acc_mean'] * 100:.2f} ± {summary['test_acc_std'] * 100:.2f} over "
            f"{cfg.runs} run(s); median epoch {summary['epoch_time_median_s']:.3f} s (training only); peak "
            f"RssAnon {fmt_bytes(mem.peak_anon)}, RSS {fmt_bytes(mem.peak_rss)}")
    if out is not None:
        _write_json_atomic(out / "summary.json", summary)
    return summary


def train_pp_from_config(cfg: Any, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """``trellis train --strategy pp``: map a :class:`trellis.train.config.TrainConfig` onto :func:`train_pp`.

    The run directory defaults like the other strategies' (``runs/<store>-<model>-<time>``) and is
    refused when it exists, unless ``--overwrite``. ``--resume`` is refused: a pre-propagation run keeps
    no checkpoints (its epochs are seconds; rerun it).
    """
    from trellis.train.runs import default_run_dir
    from trellis.train.trainer import resolve_device

    if cfg.resume:
        raise TrellisUserError("--resume is not supported with --strategy pp (no checkpoints are kept: an epoch "
                               "over pre-propagated rows takes seconds); start the run again")
    if cfg.task not in ("auto", "multiclass"):
        raise TrellisUserError(f"--task {cfg.task}: --strategy pp trains multiclass node classification")
    if cfg.metric not in (None, "acc"):
        raise TrellisUserError(f"--metric {cfg.metric}: --strategy pp selects by validation accuracy (acc)")
    device = resolve_device(cfg.device)
    out = Path(cfg.out) if cfg.out else default_run_dir(Path(str(cfg.store)).name, cfg.model)
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise TrellisUserError(f"--out {out}: run directory already exists; choose another --out or pass --overwrite")
    pcfg = PPTrainConfig(model=cfg.model, hidden=cfg.hidden, layers=cfg.layers, heads=cfg.heads,
                         dropout=cfg.dropout, lr=cfg.lr, weight_decay=cfg.weight_decay, epochs=cfg.epochs,
                         patience=cfg.patience, batch_size=cfg.batch_size, chunk_size=cfg.chunk_size,
                         memory_budget=cfg.memory_budget, loader=cfg.pp_loader, runs=cfg.runs, seed=cfg.seed,
                         device=str(device), out=str(out), target_acc=cfg.target_acc, **cfg.model_args)
    return train_pp(str(cfg.store), str(cfg.pp_dir), pcfg, log=log)


def explain_pp(cfg: Any) -> str:
    """``trellis train --strategy pp --explain``: the model, its parameter count and the placement decision."""
    from trellis.train.trainer import resolve_device

    cache = open_pp(str(cfg.pp_dir))
    cache.check_store(open_store(str(cfg.store)))
    hops = hops_used(cfg.model, cache.hops)
    placement = plan_placement(cache, hops, cfg.batch_size, loader=cfg.pp_loader, chunk_size=cfg.chunk_size,
                               memory_budget=cfg.memory_budget, device=resolve_device(cfg.device))
    num_classes = cache.num_classes or int(np.max(cache.y)) + 1
    model = build_pp_model(cfg.model, cache.num_features, cache.hops, num_classes, hidden=cfg.hidden,
                           layers=cfg.layers, heads=cfg.heads, dropout=cfg.dropout, **cfg.model_args)
    params = sum(p.numel() for p in model.parameters())
    return (f"{cfg.model} over hops {list(hops)} of {cache.path} ({cache.num_features} features per hop, "
            f"{num_classes} classes): {params:,} parameters; no graph work at training time "
            f"(preprocessing took {cache.manifest.get('build', {}).get('seconds', float('nan')):.2f} s)\n"
            + placement.describe())


def _one_run(cfg: PPTrainConfig, run: int, data: PPData, cache: PPCache, num_classes: int, device: torch.device,
             epoch_times: list[float], out: Path | None, log: Callable[[str], None] | None,
             records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    seed = cfg.seed + run
    torch.manual_seed(seed)
    kwargs = {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "dropout": cfg.dropout,
              "input_dropout": cfg.input_dropout}
    model = build_pp_model(cfg.model, cache.num_features, cache.hops, num_classes, **kwargs).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data.train.seed = seed
    best_val, best_epoch, best_state = -math.inf, -1, None
    times: list[float] = []
    run_time = 0.0  # cumulative training + evaluation wall time of this run (the trainer's time_s)
    stale = 0
    epoch = 0
    for epoch in range(cfg.epochs):
        data.train.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(())
        n_batches = 0
        t0 = time.perf_counter()
        for x, y in data.train:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y, ignore_index=-1)
            loss.backward()
            opt.step()
            loss_sum += loss.detach().cpu()
            n_batches += 1
        dt = time.perf_counter() - t0
        times.append(dt)
        epoch_times.append(dt)
        t1 = time.perf_counter()
        val, _ = _accuracy(model, data.iter_split("val"), device)
        eval_s = time.perf_counter() - t1
        run_time += dt + eval_s
        line = {"run": run, "seed": seed, "epoch": epoch, "loss": float(loss_sum) / max(1, n_batches),
                "val_acc": val, "epoch_time_s": dt, "eval_time_s": eval_s, "time_s": run_time}
        if records is not None:
            records.append(line)
        if out is not None:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        if val > best_val:
            best_val, best_epoch, stale = val, epoch, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            stale += 1
            if cfg.patience and stale >= cfg.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    if out is not None:  # best-validation weights, for `trellis predict`
        from trellis.train.runs import torch_save_atomic

        (out / "models").mkdir(exist_ok=True)
        torch_save_atomic({"format": PP_MODEL_FORMAT, "model": cfg.model, "num_features": cache.num_features,
                           "hops": cache.hops, "num_classes": num_classes, "kwargs": kwargs,
                           "pp_dir": str(cache.path), "state_dict": {k: v.detach().cpu()
                                                                     for k, v in model.state_dict().items()}},
                          out / "models" / f"run-{run}.pt")
    test, _ = _accuracy(model, data.iter_split("test"), device)
    res = {"run": run, "seed": seed, "best_epoch": best_epoch, "best_val_acc": best_val, "test_acc": test,
           "epochs_run": epoch + 1, "epoch_time_median_s": statistics.median(times)}
    if log:
        log(f"run {run} (seed {seed}): best val {best_val * 100:.2f} at epoch {best_epoch}, test {test * 100:.2f}, "
            f"{epoch + 1} epochs, median epoch {res['epoch_time_median_s']:.3f} s")
    return res


def _mean(v: list[float]) -> float:
    return float(np.mean(v)) if v else float("nan")


def _std(v: list[float]) -> float:
    return float(np.std(v)) if len(v) > 1 else 0.0
