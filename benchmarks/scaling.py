"""Measured scaling of partition-parallel training, and the cost model's prediction beside it.

``python -m benchmarks.scaling`` and ``benchmarks/bench_dist.py`` run this: on one store, the single process
(``trellis train`` without ``--parts-dir``) as the baseline, then ``trellis train --parts-dir`` at each P
for each partitioning method, every run a separate ``python -m trellis.cli train`` process. Figures come
from the run directories: the median training step over epochs >= 1 (``step_time_s``; epoch 0 includes
setup), the bytes every rank sent in a step (``exchange_bytes_per_rank``) and each rank's peak ``RssAnon``
(summary). The prediction (:mod:`trellis.plan.rank_cost`) uses the P = 1 step pinned to one core (the serial
work ``W``) and on all cores (the thread efficiency, unless given), the layouts' per-part counts, the
model's exchange shape (floats per halo row and exchanges per step, read off the first multi-rank run:
they depend on the model and the planner, not on P), a bandwidth and latency (measured by
:func:`probe_loopback`, a 2-process gloo all-to-all, unless given) and the cores. Nothing else of a
multi-rank run enters the prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.plan.rank_cost import (
    CostInputs,
    exchange_row_floats,
    halo_sent_bytes,
    predict,
    thread_efficiency,
    work_shares,
)
from trellis.utils.memory import TreeSampler

#: Partitioning methods whose layouts own edges by destination (pull): the ones the prediction covers.
PULL_METHODS = ("grem", "metis", "ldg", "fennel", "random", "hash-dst")
MIB = 2**20


@dataclass(frozen=True)
class ScalingConfig:
    """One scaling benchmark: the graph, the model, the runs and the network figures.

    Attributes:
        store: An existing store; None generates one under ``workdir`` (default: None).
        generator: ``sbm`` or ``rmat`` when generating (default: sbm).
        nodes: Nodes of the generated graph (default: 200000).
        avg_degree: Edges per node of the generated graph (default: 10).
        features: Feature width of the generated graph (default: 64).
        classes: Classes of the generated graph (default: 8).
        methods: Partitioning methods, destination-owned (default: grem, hash-dst).
        procs: Rank counts (default: 1, 2, 4).
        epochs: Epochs per run (default: 10).
        model: Model (default: gcn).
        hidden: Hidden width (default: 16).
        layers: Layers (default: 2).
        dropout: Dropout (default: 0.5).
        predict: Add the cost model's prediction (default: False).
        bandwidth: Bytes/s; None measures loopback gloo (default: None).
        latency_s: Seconds per message; None measures it (default: None).
        cores: Cores of this machine; None: ``os.cpu_count()`` (default: None).
        thread_efficiency: Intra-op thread efficiency; None measures it (default: None).
        node_weight: A node's work relative to an edge's (default: 1).
        halo_weight: A halo row's work relative to an edge's (default: 1).
        workdir: Where stores, layouts and runs go; None: a temporary directory, removed (default: None).
        seed: Seed of the generator and the runs (default: 0).
        timeout_s: Limit per child process (default: 1800).
    """

    store: Path | None = None
    generator: str = "sbm"
    nodes: int = 200_000
    avg_degree: float = 10.0
    features: int = 64
    classes: int = 8
    methods: Sequence[str] = ("grem", "hash-dst")
    procs: Sequence[int] = (1, 2, 4)
    epochs: int = 10
    model: str = "gcn"
    hidden: int = 16
    layers: int = 2
    dropout: float = 0.5
    predict: bool = False
    bandwidth: float | None = None
    latency_s: float | None = None
    cores: int | None = None
    thread_efficiency: float | None = None
    node_weight: float = 1.0
    halo_weight: float = 1.0
    workdir: Path | None = None
    seed: int = 0
    timeout_s: float = 1800.0


@dataclass
class RunFigures:
    """What one ``trellis train`` run directory says about its steps."""

    label: str
    ranks: int
    step_s: float
    sent_per_rank: list[float]
    eval_bytes: float
    peak_anon_mb: list[float]
    num_parameters: int
    summary: dict[str, Any] = field(repr=False, default_factory=dict)
    records: list[dict[str, Any]] = field(repr=False, default_factory=list)
    #: Peak RssAnon (MiB) of each training process, sampled from outside by the benchmark.
    external_peak_anon_mb: list[float] = field(default_factory=list)

    @property
    def sent_total(self) -> float:
        """Bytes all ranks sent in one training step."""
        return float(sum(self.sent_per_rank))


def _env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a child started from inside a rank must not join its job
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    return env


def _run(cmd: list[str], timeout: float, *, one_core: bool = False, env: dict[str, str] | None = None) -> str:
    """Run a child, return its stdout; RuntimeError with its last stderr line when it fails."""
    out, _ = _run_sampled(cmd, timeout, one_core=one_core, env=env, sample=False)
    return out


def _run_sampled(cmd: list[str], timeout: float, *, one_core: bool = False, env: dict[str, str] | None = None,
                 sample: bool = True, launcher: bool = False) -> tuple[str, list[float]]:
    """Run a child; its stdout and the peak RssAnon (MiB) of each training process, sampled from outside.

    The training processes are the child itself, or with ``launcher`` the ranks it started (its children).
    """
    def pin() -> None:  # pragma: no cover - runs in the child
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or _env(),
                            preexec_fn=pin if one_core else None)
    sampler = TreeSampler(proc.pid) if sample else None
    if sampler is not None:
        sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        if sampler is not None:
            sampler.stop()
    if proc.returncode != 0:
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        raise RuntimeError(f"{' '.join(cmd[2:5])}… failed (rc {proc.returncode}): {(lines or ['?'])[-1][:300]}")
    peaks: list[float] = []
    if sampler is not None:
        ranks = [pid for pid, parent in sampler.parents.items() if parent == proc.pid] if launcher else [proc.pid]
        peaks = [sampler.peaks[pid] / MIB for pid in ranks if pid in sampler.peaks]
    return stdout, peaks


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trellis.cli", *args]


# ---- the loopback link -----------------------------------------------------------------------------------
def probe_loopback(nbytes: int = 16 * MIB, iters: int = 10, timeout: float = 120.0) -> tuple[float, float]:
    """``(bytes/s, seconds per message)`` of a 2-process gloo ``all_to_all_single`` on 127.0.0.1.

    Each rank sends ``nbytes`` to its peer; the latency is the median time of a 4-byte all-to-all, the
    bandwidth ``nbytes / (t_big - latency)`` with ``t_big`` the median of ``iters`` big ones.
    """
    from trellis.distributed.comm import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        env = {**_env(1), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.scaling", "probe", str(nbytes),
                                       str(iters)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError("the loopback probe timed out") from None
        if p.returncode != 0:
            raise RuntimeError(f"the loopback probe failed: {(err.strip().splitlines() or ['?'])[-1][:300]}")
        outs.append(out)
    result = json.loads(outs[0].strip().splitlines()[-1])
    return float(result["bandwidth"]), float(result["latency_s"])


def _probe_rank(nbytes: int, iters: int) -> None:
    """One rank of :func:`probe_loopback` (``python -m benchmarks.scaling probe NBYTES ITERS``)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world)

    def timed(floats: int, n: int) -> float:
        x = torch.ones(world * floats)
        out = torch.empty_like(x)
        times = []
        for i in range(n + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_to_all_single(out, x)
            if i >= 2:
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    latency = timed(1, 50)
    big = timed(max(1, nbytes // 4), iters)
    sent = max(1, nbytes // 4) * 4 * (world - 1)
    if rank == 0:
        print(json.dumps({"bandwidth": sent / max(big - latency, 1e-9), "latency_s": latency, "bytes": sent,
                          "big_s": big}))
    dist.destroy_process_group()


# ---- stores, layouts, runs -------------------------------------------------------------------------------
def generate(cfg: ScalingConfig, out: Path) -> Path:
    """Generate the configured graph at ``out`` (a child process)."""
    _run(_cli("data", "generate", cfg.generator, "--nodes", str(cfg.nodes), "--avg-degree", f"{cfg.avg_degree:g}",
              "--features", str(cfg.features), "--classes", str(cfg.classes), "--seed", str(cfg.seed), "--out",
              str(out), "--overwrite"), cfg.timeout_s)
    return out


def partition(store: Path, parts: int, method: str, out: Path | None, timeout: float = 1800.0,
              width: int = 256) -> dict[str, Any]:
    """Partition ``store`` (a child process) and return its quality report; ``out=None`` writes no layout."""
    args = ["partition", str(store), "--parts", str(parts), "--method", method, "--json", "--width", str(width)]
    args += ["--no-layout"] if out is None else ["--out", str(out), "--overwrite"]
    report: dict[str, Any] = json.loads(_run(_cli(*args), timeout).strip().splitlines()[-1])
    return report


def train(cfg: ScalingConfig, store: Path, run_dir: Path, parts_dir: Path | None, label: str, *,
          one_core: bool = False) -> RunFigures:
    """``trellis train`` (distributed when ``parts_dir`` is given) and the figures of its run directory."""
    args = ["train", str(store), "--model", cfg.model, "--hidden", str(cfg.hidden), "--layers", str(cfg.layers),
            "--dropout", str(cfg.dropout), "--epochs", str(cfg.epochs), "--patience", str(cfg.epochs + 1),
            "--seed", str(cfg.seed), "--device", "cpu", "--checkpoint-every", "0", "--out", str(run_dir),
            "--json", "--no-progress", "--overwrite"]
    if parts_dir is not None:
        args += ["--parts-dir", str(parts_dir)]
    _, peaks = _run_sampled(_cli(*args), cfg.timeout_s, one_core=one_core, launcher=parts_dir is not None)
    fig = read_run(run_dir, label)
    fig.external_peak_anon_mb = peaks
    return fig


def read_run(run_dir: Path, label: str = "") -> RunFigures:
    """Step time, bytes and peak memory of a finished run directory."""
    with open(run_dir / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r.get("run", 0) == 0 and "step_time_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    info = summary.get("strategy_info", summary)  # gathered figures, nested or at the top level
    steady = [r for r in records if r["epoch"] >= 1] or records
    step = statistics.median(float(r["step_time_s"]) for r in steady)
    ranks = int(info.get("world_size", 1))
    per_rank: list[float] = [0.0] * ranks
    if steady and "exchange_bytes_per_rank" in steady[-1]:
        per_rank = [float(v) for v in steady[-1]["exchange_bytes_per_rank"]]
    elif steady and "exchange_bytes" in steady[-1]:
        per_rank = [float(steady[-1]["exchange_bytes"])] + [0.0] * (ranks - 1)
    eval_bytes = float(steady[-1].get("eval_exchange_bytes", 0)) if steady else 0.0
    peaks = [float(v) for v in info.get("rank_peak_rss_anon_mb", [summary.get("peak_rss_anon_mb", 0.0)])]
    return RunFigures(label, ranks, step, per_rank, eval_bytes, peaks, int(summary.get("num_parameters", 0)),
                      summary, steady)


# ---- the benchmark ---------------------------------------------------------------------------------------
def _load() -> float | None:
    """The 1-minute load average (other processes competing for the cores), None where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_scaling(cfg: ScalingConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark of ``cfg``; returns ``{"config", "machine", "rows"}`` (see :func:`format_rows`)."""
    procs = sorted(set(int(p) for p in cfg.procs))
    if not procs or procs[0] < 1:
        raise ValueError("procs must be positive")
    cores = cfg.cores or os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="trellis-bench-dist-")) if cfg.workdir is None else None
    work = tmp if tmp is not None else Path(cfg.workdir)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        load0 = _load()
        store = cfg.store
        if store is None:
            store = generate(cfg, work / f"{cfg.generator}-{cfg.nodes}")
            log(f"generated {store} in {time.perf_counter() - t0:.1f} s")
        graph = GraphStore(str(store))
        in_dim = graph.num_features
        single = train(cfg, store, work / "runs" / "single", None, "single")
        log(f"single process: step {single.step_s * 1e3:.1f} ms")
        layouts: dict[tuple[str, int], Path] = {}
        reports: dict[tuple[str, int], dict[str, Any]] = {}
        for p in procs:
            for method in (cfg.methods if p > 1 else ("hash-dst",)):
                out = work / "parts" / f"{method}-{p}"
                reports[(method, p)] = partition(store, p, method, out, cfg.timeout_s)
                layouts[(method, p)] = out
        if cfg.predict and ("hash-dst", 1) not in layouts:
            raise ValueError("--predict needs P = 1 among the rank counts (its step is the reference)")
        runs: dict[tuple[str, int], RunFigures] = {}
        one: RunFigures | None = None
        for (method, p), layout in layouts.items():
            label = f"P={p}" if p == 1 else f"{method} P={p}"
            runs[(method, p)] = train(cfg, store, work / "runs" / f"{method}-{p}", layout, label)
            log(f"{label}: step {runs[(method, p)].step_s * 1e3:.1f} ms")
            if cfg.predict and p == 1:  # the serial work W: the same step pinned to one core
                one = train(cfg, store, work / "runs" / "one-core", layout, "P=1, one core", one_core=True)
                log(f"P=1 on one core: step {one.step_s * 1e3:.1f} ms")
        machine: dict[str, Any] = {"cores": cores, "loadavg_start": load0, "loadavg_end": _load()}
        ref = runs.get(("hash-dst", 1))
        if cfg.predict and ref is not None and one is not None:
            eff = cfg.thread_efficiency
            if eff is None:
                eff = thread_efficiency(one.step_s, ref.step_s, cores)
                log(f"thread efficiency on {cores} cores: {eff:.2f}")
            bw, lat = cfg.bandwidth, cfg.latency_s
            if bw is None or lat is None:
                mbw, mlat = probe_loopback()
                bw = mbw if bw is None else bw
                lat = mlat if lat is None else lat
                log(f"loopback gloo all-to-all: {mbw / 1e9:.2f} GB/s, {mlat * 1e6:.0f} us per message")
            machine.update(serial_step_s=one.step_s, thread_efficiency=eff, bandwidth=bw, latency_s=lat,
                           num_parameters=ref.num_parameters,
                           work_units=graph.num_edges + cfg.node_weight * graph.num_nodes)
            machine.update(exchange_shape(runs, reports))
        rows = [_row("single", 0, single, single, None)]
        if one is not None:
            rows.append(_row("one core", 1, one, single, None))
        for (method, p), fig in runs.items():
            pred = None
            if "serial_step_s" in machine and (method in PULL_METHODS or p == 1):  # the model prices pull
                pred = _predict(cfg, reports[(method, p)], fig.num_parameters, machine)
            rows.append(_row(method if p > 1 else "-", p, fig, single, pred))
        cfg_out = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}
        cfg_out.update(store=str(store), in_dim=in_dim, num_nodes=graph.num_nodes,
                       num_edges=graph.num_edges, methods=list(cfg.methods), procs=procs)
        return {"config": cfg_out, "machine": machine, "rows": rows}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def exchange_shape(runs: dict[tuple[str, int], RunFigures], reports: dict[tuple[str, int], dict[str, Any]]
                   ) -> dict[str, Any]:
    """Exchanges per step and floats per halo row per step, read off the first multi-rank run.

    Both belong to the model and the planner's order (which width each layer exchanges at, which exchanges
    have a backward), not to P or the partition, so one run gives them for all.
    """
    for key, fig in runs.items():
        if fig.ranks > 1 and key[0] in PULL_METHODS:
            rec = fig.records[-1] if fig.records else {}
            exchanges = sum(1 for k, v in rec.items() if k.startswith("exchange_l") and k.endswith("_bytes") and v)
            floats = exchange_row_floats(fig.sent_total, int(sum(reports[key]["part_halo"])))
            return {"exchanges": exchanges, "row_floats": floats, "shape_from": fig.label}
    return {"exchanges": 0, "row_floats": 0.0, "shape_from": None}


def _predict(cfg: ScalingConfig, report: dict[str, Any], num_parameters: int, machine: dict[str, Any]
             ) -> dict[str, Any]:
    p = int(report["num_parts"])
    sent = halo_sent_bytes(report["part_halo"], float(machine["row_floats"])) if p > 1 else [0.0]
    work = work_shares(report["part_edges"], report["part_nodes"], report["part_halo"],
                       node_weight=cfg.node_weight, halo_weight=cfg.halo_weight)
    inp = CostInputs(ranks=p, compute_s=float(machine["serial_step_s"]), compute_threads=1,
                     thread_efficiency=float(machine["thread_efficiency"]), work=work,
                     total_work=float(report["num_edges"]) + cfg.node_weight * float(report["num_nodes"]),
                     sent_bytes=sent, exchanges=int(machine["exchanges"]), bandwidth=float(machine["bandwidth"]),
                     latency_s=float(machine["latency_s"]), cores=int(machine["cores"]), allreduces=2,
                     allreduce_bytes=4.0 * num_parameters)
    out = predict(inp).to_dict()
    out["sent_total"] = float(sum(sent))
    return out


def _row(method: str, p: int, fig: RunFigures, single: RunFigures, pred: dict[str, Any] | None) -> dict[str, Any]:
    peaks = fig.external_peak_anon_mb or fig.peak_anon_mb  # sampled from outside where the benchmark did
    base = single.external_peak_anon_mb or single.peak_anon_mb
    row: dict[str, Any] = {"method": method, "ranks": p, "step_s": fig.step_s, "speedup": single.step_s / fig.step_s,
                           "sent_bytes_step": fig.sent_total, "eval_bytes": fig.eval_bytes,
                           "sent_bytes_per_rank": fig.sent_per_rank, "rank_peak_rss_anon_mb": peaks,
                           "rank_peak_rss_anon_mb_self": fig.peak_anon_mb,
                           "peak_rss_anon_ratio": max(peaks) / max(base)}
    if pred is not None:
        row.update(predicted_s=pred["total_s"], predicted_compute_s=pred["compute_s"],
                   predicted_comm_s=pred["comm_s"], measured_over_predicted=fig.step_s / pred["total_s"],
                   predicted_sent_bytes_step=pred["sent_total"])
    return row


def format_rows(result: dict[str, Any]) -> str:
    """The benchmark's table (markdown) with the machine's figures above it."""
    rows, m = result["rows"], result["machine"]
    c = result["config"]
    lines = [f"{c['store']}: {c['num_nodes']:,} nodes, {c['num_edges']:,} edges, {c['in_dim']} features; "
             f"{c['model']} {c['layers']} layers, hidden {c['hidden']}, {c['epochs']} epochs; {m['cores']} cores"
             + ("" if m.get("loadavg_start") is None else
                f", load average {m['loadavg_start']:.1f} -> {m['loadavg_end']:.1f}")]
    predicted = "predicted_s" in rows[-1]
    if predicted:
        lines.append(f"model inputs: W = the P=1 step on one core; link {m['bandwidth'] / 1e9:.2f} GB/s, "
                     f"{m['latency_s'] * 1e6:.0f} us per message; thread efficiency {m['thread_efficiency']:.2f}; "
                     f"{m['exchanges']} exchanges per step, {m['row_floats']:.1f} floats per halo row per step "
                     f"(from {m['shape_from']}); work = edges + nodes + halo rows")
    cols = ["method", "P", "step ms", "vs single"]
    if predicted:
        cols += ["predicted ms (compute + comm)", "measured/predicted"]
    cols += ["sent MiB/step (measured)"] + (["(predicted)"] if predicted else []) + [
        "peak RssAnon MiB per rank (sampled outside)", "max rank / single"]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [r["method"], "single" if r["ranks"] == 0 else str(r["ranks"]), f"{r['step_s'] * 1e3:.1f}",
                 f"{r['speedup']:.2f}x"]
        if predicted:
            if "predicted_s" in r:
                cells += [f"{r['predicted_s'] * 1e3:.1f} ({r['predicted_compute_s'] * 1e3:.1f} + "
                          f"{r['predicted_comm_s'] * 1e3:.1f})", f"{r['measured_over_predicted']:.2f}"]
            else:
                cells += ["-", "-"]
        cells.append(f"{r['sent_bytes_step'] / MIB:.2f}")
        if predicted:
            cells.append(f"{r['predicted_sent_bytes_step'] / MIB:.2f}" if "predicted_s" in r else "-")
        cells += [", ".join(f"{v:.0f}" for v in r["rank_peak_rss_anon_mb"]), f"{r['peak_rss_anon_ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- command line (python -m benchmarks.scaling [STORE] --predict ...) --------------------------------
def _count(text: str) -> int:
    """``"200k"`` -> 200000, ``"1.5m"`` -> 1500000 (decimal suffixes k, m, g)."""
    t = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 200000, 200k, 1m)") from None


def _dist_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", nargs="?", default=None,
                   help="graph store directory (default: generate one with --generator/--nodes)")
    p.add_argument("--generator", default="sbm", choices=("sbm", "rmat"), help="generated graph (default: sbm)")
    p.add_argument("--nodes", type=_count, default=200_000, help="nodes of the generated graph (default: 200k)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="edges per node when generating (default: 10)")
    p.add_argument("--features", type=int, default=64, help="feature width when generating (default: 64)")
    p.add_argument("--classes", type=int, default=8, help="classes when generating (default: 8)")
    p.add_argument("--methods", default="grem,hash-dst", metavar="M1,M2",
                   help="partitioning methods (default: grem,hash-dst)")
    p.add_argument("--procs", default="1,2,4", metavar="P1,P2", help="rank counts, 1 included (default: 1,2,4)")
    p.add_argument("--epochs", type=int, default=10, help="epochs per run (default: 10)")
    p.add_argument("--model", default="gcn", help="model (default: gcn)")
    p.add_argument("--hidden", type=int, default=16, help="hidden width (default: 16)")
    p.add_argument("--layers", type=int, default=2, help="layers (default: 2)")
    p.add_argument("--predict", action="store_true",
                   help="add the cost model's prediction (trellis.plan.rank_cost) from the P=1 step, the layouts' "
                        "per-part counts and the measured loopback bandwidth")
    p.add_argument("--bandwidth", default=None, metavar="BYTES/S",
                   help="link bandwidth for --predict, e.g. 1.25G or 1250000000 (default: measured loopback)")
    p.add_argument("--latency", type=float, default=None, metavar="S",
                   help="seconds per message for --predict (default: measured loopback)")
    p.add_argument("--cores", type=int, default=None, help="cores of this machine (default: all)")
    p.add_argument("--thread-efficiency", type=float, default=None, metavar="E",
                   help="intra-op thread efficiency in [0, 1] (default: measured, P=1 on one core)")
    p.add_argument("--workdir", default=None, help="keep stores, layouts and runs here (default: a temporary "
                                                   "directory, removed)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _dist_run(args: argparse.Namespace) -> int:
    from trellis.partition import available_methods
    from trellis.utils.sizes import parse_size

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in available_methods()]
    if not methods or bad:
        raise TrellisUserError(f"--methods {args.methods}: choose partitioners among {', '.join(available_methods())}")
    try:
        procs = sorted({int(v) for v in args.procs.split(",") if v.strip()})
    except ValueError:
        raise TrellisUserError(f"--procs {args.procs}: comma-separated positive integers, e.g. 1,2,4") from None
    if not procs or procs[0] < 1:
        raise TrellisUserError(f"--procs {args.procs}: comma-separated positive integers, e.g. 1,2,4")
    if args.predict and 1 not in procs:
        raise TrellisUserError("--predict needs 1 in --procs: the P=1 step is the model's reference")
    if args.nodes < 2 * max(procs) or args.epochs < 2 or args.hidden < 1 or args.layers < 1:
        raise TrellisUserError("--nodes must be at least 2 x the largest P, --epochs at least 2, --hidden and "
                               "--layers positive")
    if args.thread_efficiency is not None and not 0.0 <= args.thread_efficiency <= 1.0:
        raise TrellisUserError(f"--thread-efficiency must lie in [0, 1] (got {args.thread_efficiency})")
    if args.store is not None and not (Path(args.store) / "manifest.json").exists():
        raise TrellisUserError(f"{args.store}: not a graph store (no manifest.json); create one with "
                               "`trellis data generate` or leave STORE out")
    bandwidth = None if args.bandwidth is None else float(parse_size(args.bandwidth, flag="--bandwidth"))
    if bandwidth is not None and bandwidth <= 0:
        raise TrellisUserError("--bandwidth must be positive")
    cfg = ScalingConfig(store=None if args.store is None else Path(args.store), generator=args.generator,
                        nodes=args.nodes, avg_degree=args.avg_degree, features=args.features, classes=args.classes,
                        methods=tuple(methods), procs=tuple(procs), epochs=args.epochs, model=args.model,
                        hidden=args.hidden, layers=args.layers, predict=args.predict, bandwidth=bandwidth,
                        latency_s=args.latency, cores=args.cores, thread_efficiency=args.thread_efficiency,
                        workdir=None if args.workdir is None else Path(args.workdir))
    result = run_scaling(cfg, log=(lambda s: None) if args.json else (lambda s: print(s, flush=True)))
    print(json.dumps(result) if args.json else format_rows(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.scaling``: the scaling table (``probe NBYTES ITERS`` is one probe rank)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "probe":
        _probe_rank(int(argv[1]), int(argv[2]))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0])
    _dist_args(p)
    try:
        return _dist_run(p.parse_args(argv))
    except TrellisUserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
