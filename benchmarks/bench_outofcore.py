"""Out-of-core full-batch training (``trellis train --memory-budget``): exactness, memory, time, and scale.

    python -m benchmarks.bench_outofcore [--mode exact] [--nodes 1m,2m] [--budgets 800M] [--cold]
    python -m benchmarks.bench_outofcore --mode depth [--nodes 1m] [--depths 4,8,16] [--budgets 800M]
    python -m benchmarks.bench_outofcore --mode scale [--start 1m] [--max-nodes 64m] [--scale-budget 3G]

Modes (every one prints its exact command line first and ends with a markdown table):

* ``exact``: on generated SBM stores, ``trellis train`` in memory and under each ``--budgets`` with the
  same seed, epochs and model; per run the peak ``RssAnon`` and ``VmRSS``, the median training step over
  epochs >= 1 (epoch 0 includes setup), the mean epoch wall time, spill and storage traffic per epoch,
  the peak disk use of the spill directory, and the largest per-epoch loss difference against the
  in-memory run. The verdict per budget is ``peak RssAnon <= budget`` and ``max |Δloss| <= --tol``.
* ``depth``: GCN with 4, 8 and 16 layers under a budget: epoch time, peak ``RssAnon``, whether it completed.
* ``scale``: graphs doubling in size, each trained by PyG's fastest full-batch GCN (CSR ``adj_t``,
  ``cached=True``), by Trellis in memory, and by Trellis under a fixed budget; a child whose ``RssAnon``
  passes ``--kill-above`` is killed and recorded as out of memory. The table says how far each goes.

What is measured, and why this way:

* Memory is the child's ``RssAnon`` (the memory the process allocated itself) read from
  ``/proc/<pid>/status`` every 10 ms by a thread of *this* process, so the figure does not depend on the
  trainer's own accounting and includes everything (interpreter, torch, allocator slack). ``VmRSS`` is
  reported beside it but is not what a budget caps: the store and the spill files are memory-mapped, and
  their pages count in ``VmRSS`` as page cache that the kernel can drop at any time.
* Page cache vs storage: on a machine with free RAM the store and the spill files stay in the page cache
  after their first read, so a "warm" out-of-core epoch reads nothing from storage. ``--cold`` adds runs
  with ``TRELLIS_OOC_COLD=1``, which drops the page cache of the spills and of the store before every pass,
  and drops the store's page cache before every run; ``storage_read_bytes`` then shows what came from the
  device. The storage's sequential read rate (a 1 GiB file written, dropped from the cache, read back) is
  printed beside the figures, as the bound those cold runs are measured against.
* Every run is a separate process (``python -m trellis.cli train``), so peaks are separate and a run that
  is killed cannot take the benchmark down.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from trellis.utils.memory import status_of
from trellis.utils.sizes import format_size, parse_size

MODULE = "benchmarks.bench_outofcore"
ROOT = Path(__file__).resolve().parents[1]
COLD_ENV = "TRELLIS_OOC_COLD"  # trellis.train.strategies.outofcore.COLD_ENV (not imported: it pulls in the trainer)
MIB = 2**20
GIB = 2**30
SAMPLE_S = 0.01  # RssAnon / VmRSS sampling period
SPILL_SAMPLE_S = 0.5  # spill directory disk-use sampling period
SBM_DEFAULTS = {"homophily": 0.8, "feature_noise": 1.5, "train_frac": 0.1, "val_frac": 0.1}  # `data generate`'s


# --------------------------------------------------------------------------------------------- sizes, stores

def parse_count(text: str) -> int:
    """``"20k"`` -> 20000, ``"1.5m"`` -> 1500000, ``"1000"`` -> 1000 (decimal suffixes k, m, g)."""
    t = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def count_label(n: int) -> str:
    """``1000000`` -> ``"1m"``, ``20000`` -> ``"20k"``."""
    for suffix, m in (("m", 10**6), ("k", 10**3)):
        if n >= m and n % m == 0:
            return f"{n // m}{suffix}"
    return str(n)


@dataclass(frozen=True)
class StoreSpec:
    """An SBM store as ``trellis data generate sbm`` makes it (its other options at their defaults)."""

    nodes: int
    avg_degree: float
    features: int
    classes: int = 10
    seed: int = 0

    @property
    def name(self) -> str:
        return f"sbm-{count_label(self.nodes)}-d{self.avg_degree:g}-f{self.features}"

    @property
    def edges(self) -> int:
        return int(self.nodes * self.avg_degree)

    def estimate_bytes(self) -> int:
        """Disk use of the store: features, three edge-sized int64 arrays (CSR, reverse CSR, permutation), rest."""
        return self.nodes * self.features * 4 + self.edges * 8 * 3 + self.nodes * 32

    def matches(self, source: dict[str, Any]) -> bool:
        want = {"generator": "sbm", "nodes": self.nodes, "avg_degree": self.avg_degree, "features": self.features,
                "classes": self.classes, "seed": self.seed, **SBM_DEFAULTS}
        return all(source.get(k) == v for k, v in want.items())


def find_store(data_dir: Path, spec: StoreSpec) -> Path | None:
    """A store under ``data_dir`` generated with ``spec`` (by this benchmark or by hand), if there is one."""
    candidates = [data_dir / spec.name, *sorted(p for p in data_dir.iterdir() if p.is_dir())]
    for path in candidates:
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        if spec.matches(manifest.get("source", {})):
            return path
    return None


def generate_store(data_dir: Path, spec: StoreSpec) -> Path:
    """Generate ``spec`` as ``data_dir/<spec.name>`` in a child process; raises RuntimeError on failure."""
    out = data_dir / spec.name
    cmd = [sys.executable, "-m", "trellis.cli", "data", "generate", "sbm", "--nodes", str(spec.nodes),
           "--avg-degree", f"{spec.avg_degree:g}", "--features", str(spec.features), "--classes", str(spec.classes),
           "--seed", str(spec.seed), "--out", str(out), "--overwrite"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(last_line(proc.stderr))
    print(f"generated {out} in {time.perf_counter() - t:.1f} s ({format_size(disk_bytes(out))})", flush=True)
    return out


def store_for(data_dir: Path, spec: StoreSpec) -> tuple[Path, bool]:
    """The store for ``spec`` and whether it was generated now (False: reused)."""
    found = find_store(data_dir, spec)
    if found is not None:
        print(f"reusing {found}", flush=True)
        return found, False
    return generate_store(data_dir, spec), True


def disk_bytes(path: Path) -> int:
    """Allocated bytes (``st_blocks``) of the files under ``path``, like ``du``; 0 if it does not exist."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a spill file removed while we walk
                pass
    return total


def drop_page_cache(path: Path) -> None:
    """Drop the (clean) page cache of every file under ``path`` with ``POSIX_FADV_DONTNEED``."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sequential_read_rate(directory: Path, size: int = GIB, chunk: int = 64 * MIB) -> float:
    """MiB/s of reading back a ``size`` file written (and fsynced) in ``directory``, its page cache dropped."""
    path = directory / f".bench-outofcore-read-{os.getpid()}"
    block = os.urandom(chunk)  # random, so that no layer below can compress or deduplicate it
    buf = bytearray(chunk)
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, size // chunk)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            read = 0
            while n := f.readinto(buf):
                read += n
            elapsed = time.perf_counter() - t
    finally:
        path.unlink(missing_ok=True)
    return read / MIB / elapsed


# ------------------------------------------------------------------------------------ watched child processes

def child_env(cold: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(COLD_ENV, None)
    if cold:
        env[COLD_ENV] = "1"
    return env


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "failed")[:200]


@dataclass
class Watched:
    """What :func:`run_watched` saw of a child: exit status, peaks, output."""

    rc: int
    wall_s: float
    peak_anon: int
    peak_rss: int
    peak_spill: int
    killed: str | None  # "oom" (RssAnon passed kill_above) or "timeout"; None if it ended by itself
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.killed is None


class _Sampler(threading.Thread):
    """Samples a child's ``/proc/<pid>/status`` every 10 ms (and a spill directory every 0.5 s) from outside."""

    def __init__(self, proc: subprocess.Popen[str], spill_dir: Path | None, kill_above: int | None) -> None:
        super().__init__(daemon=True)
        self.proc, self.spill_dir, self.kill_above = proc, spill_dir, kill_above
        self.peak_anon = self.peak_rss = self.peak_spill = 0
        self.oom = False
        self.done = threading.Event()

    def run(self) -> None:
        next_spill = 0.0
        while not self.done.is_set():
            status = status_of(self.proc.pid)
            if not status:
                break
            self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))
            self.peak_rss = max(self.peak_rss, status.get("VmRSS", 0))
            if self.kill_above is not None and self.peak_anon > self.kill_above:
                self.oom = True
                self.proc.kill()
                break
            now = time.monotonic()
            if self.spill_dir is not None and now >= next_spill:
                self.peak_spill = max(self.peak_spill, disk_bytes(self.spill_dir))
                next_spill = now + SPILL_SAMPLE_S
            self.done.wait(SAMPLE_S)


def run_watched(cmd: list[str], *, env: dict[str, str], spill_dir: Path | None = None,
                kill_above: int | None = None, timeout: float | None = None) -> Watched:
    """Run ``cmd``, sampling its memory (and ``spill_dir``'s disk use) from a thread of this process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    sampler = _Sampler(proc, spill_dir, kill_above)
    sampler.start()
    killed = None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        killed = "timeout"
    sampler.done.set()
    sampler.join()
    if sampler.oom:
        killed = "oom"
    return Watched(proc.returncode, time.perf_counter() - t, sampler.peak_anon, sampler.peak_rss,
                   sampler.peak_spill, killed, out, err)


def failure(w: Watched, kill_label: str = "") -> str:
    """One line for a child that did not complete (``kill_label``: the ``--kill-above`` it passed)."""
    if w.killed == "oom":
        return f"OOM (> {kill_label})"
    if w.killed == "timeout":
        return f"timeout ({w.wall_s:.0f} s)"
    return f"failed (rc {w.rc}): {last_line(w.stderr)}"


# ------------------------------------------------------------------------------------------------ trellis runs

@dataclass(frozen=True)
class TrainSpec:
    """One ``trellis train`` invocation's model and schedule."""

    epochs: int
    hidden: int
    layers: int
    model: str
    seed: int
    dropout: float


def train_cmd(store: Path, run_dir: Path, t: TrainSpec, budget: str | None, spill_dir: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "trellis.cli", "train", str(store), "--model", t.model, "--epochs", str(t.epochs),
           "--hidden", str(t.hidden), "--layers", str(t.layers), "--dropout", str(t.dropout), "--seed", str(t.seed),
           "--device", "cpu", "--checkpoint-every", "0", "--out", str(run_dir), "--no-progress", "--overwrite"]
    if budget is not None:
        assert spill_dir is not None
        cmd += ["--memory-budget", budget, "--spill-dir", str(spill_dir)]
    return cmd


@dataclass
class TrainResult:
    """A watched ``trellis train`` and the figures read from its run directory."""

    watched: Watched
    records: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.watched.ok and bool(self.records)

    @property
    def losses(self) -> list[float]:
        return [float(r["loss"]) for r in self.records]

    def _steady(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["epoch"] >= 1] or self.records

    def step_s(self) -> float:
        """Median training step over epochs >= 1 (epoch 0 includes setup; all epochs if there is only one)."""
        return statistics.median(float(r["step_time_s"]) for r in self._steady())

    def epoch_s(self) -> float:
        """Mean wall time of an epoch (increments of the cumulative ``time_s``) over epochs >= 1."""
        times = [float(r["time_s"]) for r in self.records]
        steps = [b - a for a, b in zip(times, times[1:])] or times
        return statistics.fmean(steps)

    def per_epoch_gib(self, key: str) -> float | None:
        """Mean of a byte counter over epochs >= 1, in GiB; None when the run does not record it."""
        steady = self._steady()
        if not steady or key not in steady[0]:
            return None
        return statistics.fmean(float(r[key]) for r in steady) / GIB


def run_train(store: Path, work: Path, label: str, t: TrainSpec, *, budget: str | None = None, cold: bool = False,
              drop_store_cache: bool = False, kill_above: int | None = None,
              timeout: float | None = None) -> TrainResult:
    """``trellis train`` in a watched child; run directory and spill root under ``work``."""
    run_dir = work / "runs" / label
    spill_dir = work / "spill" / label if budget is not None else None
    if spill_dir is not None:
        shutil.rmtree(spill_dir, ignore_errors=True)
        spill_dir.mkdir(parents=True)
    if drop_store_cache:
        drop_page_cache(store)
    w = run_watched(train_cmd(store, run_dir, t, budget, spill_dir), env=child_env(cold), spill_dir=spill_dir,
                    kill_above=kill_above, timeout=timeout)
    if spill_dir is not None:  # a killed run leaves its spill directory behind
        shutil.rmtree(spill_dir, ignore_errors=True)
    records: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    if w.ok:
        with open(run_dir / "metrics.jsonl") as f:
            records = [r for r in map(json.loads, f) if r.get("run", 0) == 0]
        summary = json.loads((run_dir / "summary.json").read_text())
    return TrainResult(w, records, summary)


# ---------------------------------------------------------------------------------------------------- PyG side

def pyg_installed() -> bool:
    return importlib.util.find_spec("torch_geometric") is not None


def _pyg_child(args: dict[str, Any]) -> dict[str, Any]:
    """PyG's fastest full-batch GCN (bench_fullbatch's: a CSR ``adj_t``, ``cached=True``), 2 layers, Adam, timed."""
    import numpy as np
    import torch
    from torch_geometric.nn import GCNConv
    from torch_geometric.utils import to_torch_csr_tensor

    from trellis.data.store import open_store

    torch.manual_seed(args["seed"])
    store = open_store(args["store"], verify=False)
    x = torch.from_numpy(np.ascontiguousarray(store.x))
    y = torch.from_numpy(np.ascontiguousarray(store.y))
    train = torch.from_numpy(np.ascontiguousarray(store.split("train")))
    n, c = store.num_nodes, int(store.num_classes)
    indptr = torch.from_numpy(np.asarray(store.indptr))
    src = torch.from_numpy(np.asarray(store.indices))
    dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1])
    adj_t = to_torch_csr_tensor(torch.stack([dst, src]), size=(n, n))
    del src, dst
    convs = torch.nn.ModuleList([GCNConv(x.shape[1], args["hidden"], cached=True),
                                 GCNConv(args["hidden"], c, cached=True)])
    opt = torch.optim.Adam(convs.parameters(), lr=0.01)
    convs.train()
    p = args["dropout"]
    times, losses = [], []
    for _ in range(args["steps"]):
        t = time.perf_counter()
        opt.zero_grad()
        h = torch.relu(convs[0](torch.nn.functional.dropout(x, p, True), adj_t))
        out = convs[1](torch.nn.functional.dropout(h, p, True), adj_t)
        loss = torch.nn.functional.cross_entropy(out[train], y[train])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    return {"step_times_s": times, "losses": losses}


def run_pyg(store: Path, hidden: int, dropout: float, seed: int, steps: int, kill_above: int | None,
            timeout: float | None) -> tuple[Watched, dict[str, Any]]:
    args = {"store": str(store), "hidden": hidden, "dropout": dropout, "seed": seed, "steps": steps}
    w = run_watched([sys.executable, "-m", MODULE, "--child", json.dumps(args)], env=child_env(),
                    kill_above=kill_above, timeout=timeout)
    return w, (json.loads(w.stdout.strip().splitlines()[-1]) if w.ok else {})


# ----------------------------------------------------------------------------------------------------- output

def mib(n: float) -> str:
    return f"{n / MIB:.0f}"


def gib(n: float | None) -> str:
    return "" if n is None else f"{n:.3f}"


def header(a: argparse.Namespace, data_dir: Path) -> None:
    print(f"    python -m {MODULE} " + shlex.join(sys.argv[1:]), flush=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = shutil.disk_usage(data_dir).free
    print(f"machine: {os.cpu_count()} cores, {format_size(ram)} RAM; data dir {data_dir} ({format_size(free)} free)")
    if a.read_test:
        size = parse_size(a.read_test, flag="--read-test")
        if free - size < parse_size(a.min_free):
            print("storage sequential read: skipped (not enough free disk)")
        else:
            rate = sequential_read_rate(data_dir, size)
            print(f"storage sequential read: {rate:.0f} MiB/s ({format_size(size)} file written, fsynced, "
                  "page cache dropped, read back in 64 MiB chunks)")
    print(flush=True)


def emit(rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    rows.append(row)
    print(json.dumps(row, ensure_ascii=False), flush=True)


# ------------------------------------------------------------------------------------------------------- modes

def mode_exact(a: argparse.Namespace, data_dir: Path, work: Path) -> None:
    t = TrainSpec(a.epochs or 5, a.hidden, a.layers or 2, a.model, a.seed, a.dropout)
    budgets = a.budgets.split(",")
    print(f"exact: {t.model} hidden {t.hidden}, {t.layers} layers, {t.epochs} epochs, dropout {t.dropout}, "
          f"seed {t.seed}; avg degree {a.avg_degree:g}, {a.features or 256} features\n", flush=True)
    rows: list[dict[str, Any]] = []
    verdicts: list[str] = []
    for size in a.nodes.split(","):
        spec = StoreSpec(parse_count(size), a.avg_degree, a.features or 256)
        store, _ = store_for(data_dir, spec)
        g = count_label(spec.nodes)
        plan: list[tuple[str, str | None, bool]] = [] if a.skip_in_memory else [("in-memory", None, False)]
        for b in budgets:
            plan.append((b, b, False))
            if a.cold:
                plan.append((f"{b} cold", b, True))
        ref: list[float] | None = None
        ref_label = ""
        for label, budget, cold in plan:
            r = run_train(store, work, f"{g}-{label.replace(' ', '-')}", t, budget=budget, cold=cold,
                          drop_store_cache=a.cold, timeout=a.timeout)
            row: dict[str, Any] = {"graph": g, "run": label}
            if not r.ok:
                row["status"] = failure(r.watched)
                emit(rows, row)
                if budget is not None:
                    verdicts.append(f"{g} {label}: FAIL ({row['status']})")
                continue
            if ref is None:
                ref, ref_label = r.losses, label
            dloss = max((abs(x - y) for x, y in zip(r.losses, ref)), default=0.0)
            same_len = len(r.losses) == len(ref)
            row.update({
                "peak RssAnon MiB": mib(r.watched.peak_anon), "peak VmRSS MiB": mib(r.watched.peak_rss),
                "step s (median ep>=1)": r.step_s(), "epoch s (mean)": r.epoch_s(),
                "spill written GiB/ep": gib(r.per_epoch_gib("spill_written_bytes")),
                "spill read GiB/ep": gib(r.per_epoch_gib("spill_read_bytes")),
                "spill gathered GiB/ep": gib(r.per_epoch_gib("spill_gathered_bytes")),
                "storage read GiB/ep": gib(r.per_epoch_gib("storage_read_bytes")),
                "peak spill disk GiB": gib(r.watched.peak_spill / GIB) if budget else "",
                "tiles": r.summary.get("tiles", ""),
                f"max abs Δloss vs {'in-memory' if not a.skip_in_memory else 'first budget'}":
                    "(reference)" if label == ref_label else f"{dloss:.2e}" + ("" if same_len else " (epochs differ)"),
                "status": "ok",
            })
            emit(rows, row)
            if budget is not None:
                limit = parse_size(budget, flag="--budgets")
                mem_ok = r.watched.peak_anon <= limit
                loss_ok = same_len and dloss <= a.tol
                verdicts.append(
                    f"{g} {label}: peak RssAnon {mib(r.watched.peak_anon)} MiB <= budget {budget} "
                    f"({mib(limit)} MiB): {'PASS' if mem_ok else 'FAIL'}; max |Δloss| vs {ref_label} {dloss:.2e} "
                    f"<= {a.tol:g}: {'PASS' if loss_ok else 'FAIL'}")
    print()
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
    print()
    for v in verdicts:
        print("verdict: " + v)


def mode_depth(a: argparse.Namespace, data_dir: Path, work: Path) -> None:
    depths = [int(d) for d in a.depths.split(",")]
    epochs = a.epochs or 3
    print(f"depth: {a.model} hidden {a.hidden}, layers {depths}, {epochs} epochs, dropout {a.dropout}, "
          f"seed {a.seed}; avg degree {a.avg_degree:g}, {a.features or 256} features\n", flush=True)
    rows: list[dict[str, Any]] = []
    for size in a.nodes.split(","):
        spec = StoreSpec(parse_count(size), a.avg_degree, a.features or 256)
        store, _ = store_for(data_dir, spec)
        g = count_label(spec.nodes)
        for layers in depths:
            t = TrainSpec(epochs, a.hidden, layers, a.model, a.seed, a.dropout)
            for budget in a.budgets.split(","):
                r = run_train(store, work, f"{g}-L{layers}-{budget}", t, budget=budget, timeout=a.timeout)
                row: dict[str, Any] = {"graph": g, "layers": layers, "budget": budget,
                                       "completed": "yes" if r.ok else "no"}
                if r.ok:
                    within = r.watched.peak_anon <= parse_size(budget, flag="--budgets")
                    row.update({
                        "epoch s (mean)": r.epoch_s(), "step s (median ep>=1)": r.step_s(),
                        "peak RssAnon MiB": mib(r.watched.peak_anon), "within budget": "yes" if within else "NO",
                        "peak VmRSS MiB": mib(r.watched.peak_rss), "tiles": r.summary.get("tiles", ""),
                        "spill written GiB/ep": gib(r.per_epoch_gib("spill_written_bytes")),
                        "peak spill disk GiB": gib(r.watched.peak_spill / GIB),
                        "final loss": f"{r.losses[-1]:.4f}"})
                else:
                    row["note"] = failure(r.watched)
                emit(rows, row)
    print()
    print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))


def mode_scale(a: argparse.Namespace, data_dir: Path, work: Path) -> None:
    features = a.features or 128
    t = TrainSpec(a.epochs or 2, a.hidden, 2, "gcn", a.seed, a.dropout)
    kill_above = parse_size(a.kill_above, flag="--kill-above")
    kill_label = a.kill_above
    min_free = parse_size(a.min_free, flag="--min-free")
    budget = a.scale_budget
    systems = ["PyG", "trellis in-memory", f"trellis {budget}"]
    failed: dict[str, str] = {} if pyg_installed() else {"PyG": "not installed"}
    print(f"scale: GCN hidden {t.hidden}, 2 layers, {t.epochs} epochs (steps), dropout {t.dropout}; avg degree "
          f"{a.avg_degree:g}, {features} features; a child is killed above {kill_label} RssAnon\n", flush=True)
    rows: list[dict[str, Any]] = []
    nodes, max_nodes = parse_count(a.start), parse_count(a.max_nodes)
    while nodes <= max_nodes and len(failed) < len(systems):
        spec = StoreSpec(nodes, a.avg_degree, features)
        g = count_label(nodes)
        base = {"graph": g, "nodes": nodes, "edges": spec.edges}
        store = find_store(data_dir, spec)
        generated = False
        if store is None:
            free = shutil.disk_usage(data_dir).free
            if free - spec.estimate_bytes() < min_free:
                emit(rows, {**base, "system": "all", "completed": "no",
                            "note": f"disk: store needs ~{format_size(spec.estimate_bytes())}, "
                                    f"{format_size(free)} free, keeping {a.min_free} free"})
                break
            try:
                store, generated = generate_store(data_dir, spec), True
            except RuntimeError as e:
                emit(rows, {**base, "system": "all", "completed": "no", "note": f"generate failed: {e}"})
                break
        else:
            print(f"reusing {store}", flush=True)
        store_disk = disk_bytes(store)
        for system in systems:
            row: dict[str, Any] = {**base, "system": system}
            if system in failed:
                emit(rows, {**row, "completed": "no", "note": failed[system]})
                continue
            if system == "PyG":
                w, res = run_pyg(store, t.hidden, t.dropout, t.seed, t.epochs, kill_above, a.timeout)
                step = res["step_times_s"][-1] if w.ok else None  # the last step: the first builds the cache
            else:
                r = run_train(store, work, f"scale-{g}-{system.split()[-1]}", t,
                              budget=None if system == "trellis in-memory" else budget,
                              kill_above=kill_above, timeout=a.timeout)
                w, step = r.watched, (r.step_s() if r.ok else None)
            row["completed"] = "yes" if step is not None else "no"
            if step is not None:
                row.update({"step s": step, "peak RssAnon MiB": mib(w.peak_anon),
                            "disk GiB (store + peak spill)": f"{(store_disk + w.peak_spill) / GIB:.2f}"})
            else:
                reason = failure(w, kill_label)
                failed[system] = f"not run: failed at {g}"
                row.update({"peak RssAnon MiB": mib(w.peak_anon), "note": reason})
            emit(rows, row)
        if a.cleanup and generated:
            shutil.rmtree(store, ignore_errors=True)
        nodes *= 2
    print()
    print_table(rows, ["graph", "nodes", "edges", "system", "completed", "step s", "peak RssAnon MiB",
                       "disk GiB (store + peak spill)", "note"])


def default_data_dir() -> Path:
    big = Path("/work/bigdata")
    return big if big.is_dir() else Path(tempfile.gettempdir()) / "trellis-bench-outofcore"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("exact", "depth", "scale"), default="exact", help="(default: %(default)s)")
    p.add_argument("--nodes", default="1m",
                   help="exact/depth: comma-separated graph sizes, k/m suffixes (default: %(default)s)")
    p.add_argument("--budgets", default="800M",
                   help="exact/depth: comma-separated --memory-budget values (default: %(default)s)")
    p.add_argument("--depths", default="4,8,16", help="depth: GCN layer counts (default: %(default)s)")
    p.add_argument("--start", default="1m", help="scale: first graph size, doubled up to --max-nodes "
                                                 "(default: %(default)s)")
    p.add_argument("--max-nodes", default="64m", help="scale: largest graph size (default: %(default)s)")
    p.add_argument("--scale-budget", default="3G", help="scale: the fixed --memory-budget (default: %(default)s)")
    p.add_argument("--kill-above", default="20G",
                   help="scale: kill a child whose RssAnon passes this (default: %(default)s)")
    p.add_argument("--min-free", default="5G",
                   help="disk to keep free; scale stops with 'disk' before a store would eat into it "
                        "(default: %(default)s)")
    p.add_argument("--cleanup", action="store_true", help="scale: delete each generated store after its size")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="stores (reused when present), runs and spills (default: /work/bigdata if it exists, "
                        "else a directory under the temp dir)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="(default: %(default)s)")
    p.add_argument("--features", type=int, default=None, help="feature width (default: 256; scale 128)")
    p.add_argument("--model", default="gcn", help="exact/depth: model (default: %(default)s; scale is always GCN)")
    p.add_argument("--hidden", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="exact: layers (default: 2; scale always 2)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: exact 5, depth 3, scale 2)")
    p.add_argument("--dropout", type=float, default=0.5, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--tol", type=float, default=1e-5,
                   help="exact: largest accepted per-epoch |Δloss| (default: %(default)s)")
    p.add_argument("--skip-in-memory", action="store_true", help="exact: compare with the first budget instead")
    p.add_argument("--cold", action="store_true",
                   help=f"exact: add budgeted runs with {COLD_ENV}=1 and drop the store's page cache before each run")
    p.add_argument("--read-test", default="1GiB",
                   help="size of the storage sequential-read test file; 0 skips it (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="seconds after which a child is killed (default: none)")
    a = p.parse_args()
    if a.child:
        print(json.dumps(_pyg_child(json.loads(a.child))))
        return
    data_dir = (a.data_dir or default_data_dir()).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    work = data_dir / "bench-outofcore"
    if a.read_test in ("0", ""):
        a.read_test = None
    header(a, data_dir)
    {"exact": mode_exact, "depth": mode_depth, "scale": mode_scale}[a.mode](a, data_dir, work)


if __name__ == "__main__":
    main()
