"""Mini-batch training beyond memory: the partition buffer against the same training in memory and a memory map.

    python -m benchmarks.bench_buffer beyond --store STORE --parts PART_DIR [--cap 3G --budget 2400M]
    python -m benchmarks.bench_buffer producer --store STORE [--trainer-threads T]  # --samplers 1: epoch vs its halves

Runs, one after another (never two at once: this machine has 2 cores):

1. the storage's sequential rate (a part's feature file read cold in 1 MiB blocks) and random 4 KiB read rate
   (``O_DIRECT`` reads at random offsets), and the epoch's storage floor = bytes the buffer reads / sequential rate;
2. ``buffer``: one training epoch through the partition buffer under ``memcap CAP`` (page cache counted, starts
   cold), with ``--memory-budget BUDGET``;
3. ``in memory``: the same epoch with ``--strategy mini`` reading the store (no cap: its 8 GB stay in the page
   cache after a first, untimed epoch);
4. batch preparation alone (sampling + feature rows, no model) under the same cap: the buffer's whole epoch
   against ``--strategy mini``'s sampler reading the store through a memory map for ``--mmap-batches`` batches,
   in batches per second.

Each child prints one JSON line; memcap's peak (anon + cache) is parsed from its output. Only the training step
is timed (evaluation is not part of an epoch here).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMCAP = ROOT.parent / "shared" / "tools" / "memcap"
MIB = 1 << 20


def sequential_rate(path: Path) -> float:
    """Bytes per second reading ``path`` cold in 1 MiB blocks."""
    from trellis.utils.spill import drop_file_cache

    drop_file_cache(path)
    buf = bytearray(MIB)
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    rate = n / (time.perf_counter() - t0)
    drop_file_cache(path)
    return rate


def random_rate(path: Path, reads: int = 3000) -> float:
    """Random 4 KiB reads per second at queue depth 1 (``O_DIRECT``: the page cache cannot serve them)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    rng = random.Random(0)
    t0 = time.perf_counter()
    try:
        for _ in range(reads):
            os.preadv(fd, [buf], rng.randrange(0, size // 4096) * 4096)
    finally:
        os.close(fd)
    return reads / (time.perf_counter() - t0)


def _child(args: list[str], cap: str | None) -> tuple[dict, float | None]:
    cmd = [sys.executable, "-m", "benchmarks.bench_buffer", *args]
    if cap is not None:
        cmd = [str(MEMCAP), cap, "--", *cmd]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"child failed ({out.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    peak = re.search(r"peak[^0-9]*([0-9.]+)\s*([KMG]i?B)", text)
    peak_mb = None
    if peak:
        scale = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}[peak.group(2)[0]]
        peak_mb = float(peak.group(1)) * scale
    return json.loads(line), peak_mb


# ---- children -----------------------------------------------------------------------------------
def _config(a: argparse.Namespace, buffer: bool) -> object:
    from trellis.train.config import TrainConfig

    kw = dict(store=a.store, strategy="mini", model="sage", hidden=a.hidden, fanouts=a.fanouts, batch_size=a.batch_size,
              epochs=a.epochs, progress=False, device="cpu", prefetch=a.prefetch)
    if buffer:
        kw.update(parts_dir=a.parts, nproc=1, memory_budget=a.budget)
        if a.buffer_parts:
            kw["buffer_parts"] = a.buffer_parts
    return TrainConfig(**kw)


def child_epoch(a: argparse.Namespace) -> None:
    """Train ``--epochs`` epochs (training steps only) and print their times and the buffer's counters."""
    import torch

    from trellis.train.build import build_run_optimizer, default_model_factory
    from trellis.train.strategies import strategy_class
    from trellis.utils.memory import proc_io

    cfg = _config(a, a.mode == "buffer")
    cls = strategy_class("mini").for_config(cfg)  # type: ignore[arg-type]
    strategy = cls(cfg, torch.device("cpu"))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    strategy.load()
    load_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = strategy.build_model(default_model_factory)
    opt = build_run_optimizer(cfg, model)  # type: ignore[arg-type]
    epochs = []
    for e in range(a.epochs):
        io0 = proc_io().get("read_bytes", 0)
        t0 = time.perf_counter()
        loss = float(strategy.train_step(model, opt, strategy.task, e))
        dt = time.perf_counter() - t0
        epochs.append({"epoch_s": dt, "loss": loss, "read_bytes": proc_io().get("read_bytes", 0) - io0,
                       **{k: v for k, v in strategy.epoch_info().items() if isinstance(v, float)}})
    info = {"load_s": load_s, "epochs": epochs}
    plan = getattr(strategy, "plan", None)
    if plan is not None:
        info.update(capacity=plan.capacity, cache_rows=plan.cache_rows, table=plan.table())
    strategy.close()
    print(json.dumps(info))


def child_prep(a: argparse.Namespace) -> None:
    """Batch preparation only: the buffer's whole epoch, or the memory-mapped sampler's first ``--batches``."""
    import torch

    from trellis.train.strategies import strategy_class

    cfg = _config(a, a.mode == "buffer-prep")
    cls = strategy_class("mini").for_config(cfg)  # type: ignore[arg-type]
    strategy = cls(cfg, torch.device("cpu"))  # type: ignore[arg-type]
    strategy.load()
    t0 = time.perf_counter()
    n = 0
    rows = 0
    for batch in strategy.loader.epoch(1):  # type: ignore[attr-defined]
        n += 1
        rows += batch.num_inputs
        if a.mode == "mmap-prep" and n >= a.batches:
            break
    dt = time.perf_counter() - t0
    strategy.close()
    print(json.dumps({"batches": n, "seconds": dt, "batches_per_s": n / dt, "rows": rows}))


def producer(a: argparse.Namespace) -> None:
    """One sampler process beside the trainer: the epoch against its sampling-only and training-only parts.

    ``--strategy mini --samplers 1`` on ``--store``: (1) the epoch's batches from the sampler process with no
    model (sampling-only), (2) the same batches trained from memory with no preparation (training-only),
    (3) the whole epoch with the sampler process preparing while the trainer trains. On 2 cores the sampler
    process (one thread) and the trainer (its torch threads) share them.
    """
    import torch

    from trellis.loader.producer import BatchProducer, ProducerOptions
    from trellis.train.build import build_run_optimizer, default_model_factory
    from trellis.train.config import TrainConfig
    from trellis.train.strategies import strategy_class

    if a.trainer_threads:  # torch's and numba's: one core each for the trainer and the sampler on 2 cores
        from trellis.utils.numba import set_threads

        set_threads(a.trainer_threads)
    cfg = TrainConfig(store=a.store, strategy="mini", model="sage", hidden=a.hidden, fanouts=a.fanouts,
                      batch_size=a.batch_size, epochs=1, progress=False, device="cpu", prefetch=2, samplers=1)
    strategy = strategy_class("mini").for_config(cfg)(cfg, torch.device("cpu"))
    strategy.load()
    torch.manual_seed(0)
    model = strategy.build_model(default_model_factory)
    opt = build_run_optimizer(cfg, model)
    with BatchProducer(strategy.loader, ProducerOptions.from_flags(1, prefetch=2)).start() as prod:
        list(prod.epoch(0))  # warm-up: worker start, numba caches
        t0 = time.perf_counter()
        kept = [b.to("cpu") for b in prod.epoch(1)]  # sampling only (the consumer only keeps them)
        sampling = time.perf_counter() - t0
    model.train()
    t0 = time.perf_counter()
    for b in kept:  # training only
        opt.zero_grad(set_to_none=True)
        loss, _ = strategy._loss(model, b, strategy.task)
        loss.backward()
        opt.step()
    training = time.perf_counter() - t0
    del kept
    strategy.train_step(model, opt, strategy.task, 0)  # starts the strategy's own sampler process
    t0 = time.perf_counter()
    strategy.train_step(model, opt, strategy.task, 1)
    both = time.perf_counter() - t0
    strategy.close()
    bound = max(sampling, training)
    for name, v in (("sampling only (1 sampler process)", sampling), ("training only (batches in memory)", training),
                    ("epoch with --samplers 1", both)):
        print(f"{name:<40} {v:8.2f} s")
    print(f"{'epoch / max(sampling, training)':<40} {both / bound:8.2f}x  (goal <= 1.1x)")
    print(json.dumps({"sampling_s": sampling, "training_s": training, "epoch_s": both, "ratio": both / bound}))


# ---- driver -------------------------------------------------------------------------------------------
def beyond(a: argparse.Namespace) -> None:
    parts = Path(a.parts)
    seq = sequential_rate(parts / "part-00000" / "x.npy")
    rnd = random_rate(parts / "part-00001" / "x.npy")
    print(f"storage: sequential {seq / 1e6:,.0f} MB/s, random 4 KiB {rnd:,.0f} reads/s", flush=True)
    common = ["--store", a.store, "--parts", a.parts, "--budget", a.budget, "--hidden", str(a.hidden), "--fanouts",
              a.fanouts, "--batch-size", str(a.batch_size), "--prefetch", str(a.prefetch)]
    if a.buffer_parts:
        common += ["--buffer-parts", str(a.buffer_parts)]
    buf, buf_peak = _child(["_epoch", "--mode", "buffer", "--epochs", str(a.epochs), *common], a.cap)
    print(buf.get("table", ""), flush=True)
    mem, _ = _child(["_epoch", "--mode", "memory", "--epochs", "2", *common], None)
    bprep, bprep_peak = _child(["_prep", "--mode", "buffer-prep", *common], a.cap)
    mprep, mprep_peak = _child(["_prep", "--mode", "mmap-prep", "--batches", str(a.mmap_batches), *common], a.cap)
    last = buf["epochs"][-1]
    data_bytes = sum(f.stat().st_size for f in parts.rglob("*.npy") if f.parent.name.startswith("part-")
                     and f.name in ("x.npy", "indptr.npy", "indices.npy", "local_to_global.npy"))
    floor = last["buffer_bytes_read"] / seq
    mem_s = mem["epochs"][-1]["epoch_s"]
    bound = max(floor, mem_s)
    rows = [
        (f"buffer epoch (memcap {a.cap})", f"{last['epoch_s']:.1f} s", f"peak {buf_peak or float('nan'):.0f} MiB"),
        ("in-memory epoch (mini, warm)", f"{mem_s:.1f} s", ""),
        ("storage floor (bytes read / seq rate)", f"{floor:.1f} s", f"{last['buffer_bytes_read'] / 1e9:.2f} GB"),
        ("epoch / max(floor, in memory)", f"{last['epoch_s'] / bound:.2f}x", "goal <= 1.25x"),
        ("bytes read / partitioned data", f"{last['read_bytes'] / data_bytes:.3f}x",
         f"storage {last['read_bytes'] / 1e9:.2f} GB of {data_bytes / 1e9:.2f} GB"),
        ("load wait", f"{last['load_wait_s']:.1f} s", f"{int(last['parts_loaded'])} parts loaded"),
        ("batch prep: buffer", f"{bprep['batches_per_s']:.2f} batches/s", f"peak {bprep_peak or float('nan'):.0f} MiB"),
        (f"batch prep: memory map ({mprep['batches']} batches)", f"{mprep['batches_per_s']:.3f} batches/s",
         f"peak {mprep_peak or float('nan'):.0f} MiB"),
        ("batch prep ratio", f"{bprep['batches_per_s'] / mprep['batches_per_s']:.1f}x", "goal >= 30x"),
    ]
    for name, val, extra in rows:
        print(f"{name:<40} {val:>16}  {extra}")
    print(json.dumps({"sequential_Bps": seq, "random_iops": rnd, "buffer": buf, "memory": mem, "buffer_prep": bprep,
                      "mmap_prep": mprep, "buffer_peak_mb": buf_peak, "data_bytes": data_bytes}, default=str))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=["beyond", "producer", "_epoch", "_prep"])
    p.add_argument("--store", required=True)
    p.add_argument("--parts")
    p.add_argument("--cap", default="3G")
    p.add_argument("--budget", default="2400M")
    p.add_argument("--buffer-parts", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--mmap-batches", type=int, default=5)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--mode", default="buffer")
    p.add_argument("--trainer-threads", type=int, default=0,
                   help="producer: the trainer's torch and numba threads (default: 0 = as they are)")
    a = p.parse_args(argv)
    {"beyond": beyond, "producer": producer, "_epoch": child_epoch, "_prep": child_prep}[a.cmd](a)


if __name__ == "__main__":
    main()
