"""Trainer throughput as sampler processes are added, until the trainer saturates (Armada Fig. 8).

    python -m benchmarks.bench_samplers --store STORE [--samplers 0,1,2,4,8] [--device cpu|cuda]

``--strategy mini`` (GraphSAGE, ``--fanouts``, ``--batch-size``) on ``--store``, in this process, imported the way
the ``trellis`` command imports it (trellis before torch, so its thread settings apply). First the trainer's
ceiling: the epoch's batches prepared beforehand and kept in memory, then trained with no preparation
(training only). Then, for each K in ``--samplers``: the epoch's batches from K sampler processes with no model
(sampling only: first with a fresh shared buffer per batch, then with recycled buffers, what training uses),
and the training epoch with ``--samplers K`` (K = 0: batches prepared on the loader's thread, as ``--strategy
mini`` does by default) after a warm-up epoch (worker start, compiled kernels). The training-only pass and the
epochs are timed ``--repeats`` times, interleaved, and their medians compared (one pass of each swung by up
to 30% on the 2-core machine). ``--compare-background``: for K >= 1, the epoch both with the sampler processes
in the background (``ProducerOptions.background``, what training does when they share the trainer's cores)
and at normal priority, alternating. Printed per K: sampling-only batches per second, the epoch, training
targets per second, and the epoch over the training-only one (1.0 = the trainer is saturated; preparation is
hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

# isort: off
import trellis  # noqa: F401  - first, as the trellis command does: its thread settings precede torch's start
import torch

# isort: on


def _strategy(a: argparse.Namespace, samplers: int) -> Any:
    from trellis.train.config import TrainConfig
    from trellis.train.strategies import strategy_class

    cfg = TrainConfig(store=a.store, strategy="mini", model="sage", hidden=a.hidden, fanouts=a.fanouts,
                      batch_size=a.batch_size, epochs=1, progress=False, device=a.device, prefetch=a.prefetch,
                      samplers=samplers, feature_residency=a.feature_residency)
    strategy = strategy_class("mini").for_config(cfg)(cfg, torch.device(a.device))
    strategy.load()
    return strategy


def _model(strategy: Any) -> tuple[Any, Any]:
    from trellis.train.build import build_run_optimizer, default_model_factory

    torch.manual_seed(0)
    model = strategy.build_model(default_model_factory).to(strategy.device)
    return model, build_run_optimizer(strategy.cfg, model)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train_pass(strategy: Any, model: Any, opt: Any, batches: list[Any], device: str) -> float:
    """Seconds to train ``batches`` (already prepared) once."""
    _sync(device)
    t0 = time.perf_counter()
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss, _ = strategy._loss(model, b, strategy.task)
        loss.backward()
        opt.step()
    _sync(device)
    return time.perf_counter() - t0


def training_only(a: argparse.Namespace) -> tuple[Any, Any, Any, list[Any]]:
    """The strategy, model, optimizer and one epoch's batches held in memory (on the device), warmed up."""
    strategy = _strategy(a, 0)
    kept = [b.to(strategy.device) for b in strategy.loader.epoch(1)]
    model, opt = _model(strategy)
    model.train()
    _train_pass(strategy, model, opt, kept, a.device)  # warms the kernels and the allocator
    return strategy, model, opt, kept


def sampling_only(a: argparse.Namespace, samplers: int, recycle: bool = True) -> float:
    """Batches per second that ``samplers`` processes prepare when nothing trains (consumer discards them).

    ``recycle``: workers reuse their shared buffers (what training uses); False: a fresh buffer per batch.
    """
    from trellis.loader.producer import BatchProducer, ProducerOptions

    strategy = _strategy(a, samplers)
    opts = ProducerOptions.from_flags(samplers, prefetch=max(a.prefetch, 2 * samplers), recycle=recycle)
    with BatchProducer(strategy.loader, opts).start() as prod:
        list(prod.epoch(0))  # warm-up
        pids = prod.pids
        before = _cpu(pids)
        t0 = time.perf_counter()
        n = sum(1 for _ in prod.epoch(1))
        seconds = time.perf_counter() - t0
        after = _cpu(pids)
    strategy.close()
    # Where the epoch's CPU went, per batch: the sampler processes together and the consumer. Workers busy for
    # less than the wall time mean they wait (on the consumer, the pipe); system time growing with K means they
    # contend in the kernel (page faults, shared memory).
    used = {key: (after[key] - before[key]) / n * 1e3 for key in before}
    print(f"   K={samplers} {'recycled' if recycle else 'fresh'} buffers: {n / seconds:.1f} batches/s, "
          f"{seconds / n * 1e3:.1f} ms/batch wall; CPU ms/batch: samplers user {used['w_user']:.1f} "
          f"sys {used['w_sys']:.1f}, consumer user {used['c_user']:.1f} sys {used['c_sys']:.1f}", flush=True)
    return n / seconds


def _cpu(pids: list[int]) -> dict[str, float]:
    """User and system CPU seconds of the processes ``pids`` together and of this one."""
    import resource

    tick = os.sysconf("SC_CLK_TCK")
    w_user = w_sys = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        w_user += int(fields[11]) / tick
        w_sys += int(fields[12]) / tick
    me = resource.getrusage(resource.RUSAGE_SELF)
    return {"w_user": w_user, "w_sys": w_sys, "c_user": me.ru_utime, "c_sys": me.ru_stime}


def epoch_strategy(a: argparse.Namespace, samplers: int, background: bool | None = None) -> Any:
    """A ``--samplers`` strategy and its model after a warm-up epoch; ``background`` None: as training decides."""
    from trellis.loader.producer import BatchProducer, ProducerOptions
    from trellis.train.strategies.batches import leave_cores
    from trellis.utils.priority import PriorityTrial

    strategy = _strategy(a, samplers)
    if samplers > 0 and background is not None:  # the strategy's own producer, with the priority forced
        strategy._threads = leave_cores(samplers)
        opts = ProducerOptions.from_flags(samplers, prefetch=a.prefetch, recycle=True, background=background)
        strategy._producer = BatchProducer(strategy.loader, opts).start()
        strategy._priority = trial = PriorityTrial()
        trial.choice = background  # no trial: this priority in every epoch
    model, opt = _model(strategy)
    strategy.train_step(model, opt, strategy.task, 0)
    return strategy, model, opt


def timed_epoch(strategy: Any, model: Any, opt: Any, epoch: int, device: str) -> dict[str, float]:
    """One timed training epoch."""
    _sync(device)
    t0 = time.perf_counter()
    strategy.train_step(model, opt, strategy.task, epoch)
    _sync(device)
    return {"epoch_s": time.perf_counter() - t0, "targets": strategy.last_epoch["targets"],
            "wait_s": strategy.last_epoch["wait_s"], "trainer_threads": torch.get_num_threads()}


def _build_alone(a: argparse.Namespace, shared: bool, q: Any) -> None:
    """In a fresh process: build the epoch's batches in this thread, timing sampling+gather and encoding."""
    from trellis.loader.producer import _shared_buffer, encode_batch
    from trellis.utils.numba import set_threads

    set_threads(1)
    strategy = _strategy(a, 0)
    loader = strategy.loader
    plan = loader.plan(0)
    for i in range(min(3, len(loader))):
        loader.get(plan, i)  # warm-up: compiled kernels, page cache
    build = encode = 0.0
    fds: list[int] = []

    def alloc(size: int) -> torch.Tensor:
        fd, buf = _shared_buffer(size)
        fds.append(fd)
        return buf

    plan = loader.plan(1)
    for i in range(len(loader)):
        t0 = time.perf_counter()
        batch = loader.get(plan, i)
        t1 = time.perf_counter()
        msg = encode_batch(batch, alloc if shared else None)
        del msg, batch
        for fd in fds:
            os.close(fd)
        fds.clear()
        encode += time.perf_counter() - t1
        build += t1 - t0
    q.put({"batches": len(loader), "build_s": build, "encode_s": encode})


def diagnose(a: argparse.Namespace, counts: list[int]) -> None:
    """K processes building the same epoch at once, each on one thread: does batch preparation scale?

    Each process samples and gathers every batch of the epoch, then encodes it into fresh shared memory
    (``--samplers``' message) or private memory. Batches per second per process falling with K means the
    processes contend for something below the producer (memory, the kernel); a flat rate means they do not.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"{'processes':>9} {'memory':>8} {'build ms/batch':>15} {'encode ms/batch':>16} {'batches/s each':>15}")
    for k in [c for c in counts if c > 0]:
        for shared in (True, False):
            q = ctx.Queue()
            procs = [ctx.Process(target=_build_alone, args=(a, shared, q)) for _ in range(k)]
            for pr in procs:
                pr.start()
            res = [q.get() for _ in procs]
            for pr in procs:
                pr.join()
            b = sum(r["batches"] for r in res)
            build = sum(r["build_s"] for r in res) / b * 1e3
            enc = sum(r["encode_s"] for r in res) / b * 1e3
            print(f"{k:>9} {'shared' if shared else 'private':>8} {build:>15.1f} {enc:>16.1f} "
                  f"{1e3 / (build + enc):>15.1f}", flush=True)
    train_where(a)


def train_where(a: argparse.Namespace) -> None:
    """Training the same batches held in shared memory (as a sampler process's message) and in private memory."""
    from trellis.loader.producer import BatchMessage, _shared_buffer, decode_batch, encode_batch

    strategy = _strategy(a, 0)
    fds: list[int] = []

    def alloc(size: int) -> torch.Tensor:
        fd, buf = _shared_buffer(size)
        fds.append(fd)
        return buf

    built = list(strategy.loader.epoch(1))
    model, opt = _model(strategy)
    model.train()
    for where in ("shared", "private", "shared", "private"):
        kept = []
        for b in built:
            m = encode_batch(b, alloc if where == "shared" else None)
            kept.append(decode_batch(BatchMessage(m.header, m.payload)))
        seconds = _train_pass(strategy, model, opt, kept, a.device)
        print(f"training {len(kept)} batches held in {where} memory: {seconds:.2f} s "
              f"({torch.get_num_threads()} threads)", flush=True)
        del kept
        for fd in fds:
            os.close(fd)
        fds.clear()
    strategy.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--samplers", default="0,1,2,4,8", help="sampler process counts, comma-separated")
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--feature-residency", default="host", choices=["host", "device", "auto"],
                   help="where the input rows live (device: the trainer gathers them; the samplers only sample)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each, interleaved (medians reported)")
    p.add_argument("--compare-background", action="store_true",
                   help="for K >= 1, time the epoch with the samplers in the background and at normal priority")
    p.add_argument("--diagnose", action="store_true",
                   help="instead: K processes building batches at once, timed in parts (no producer, no trainer)")
    a = p.parse_args(argv)
    counts = [int(k) for k in a.samplers.split(",")]
    if a.diagnose:
        diagnose(a, counts)
        return
    base, base_model, base_opt, kept = training_only(a)
    targets = sum(int(b.num_targets) for b in kept)
    print(f"device {a.device}, {torch.get_num_threads()} torch threads, {a.repeats} interleaved repeats "
          "(medians)", flush=True)
    print(f"{'samplers':>8} {'priority':>10} {'fresh buffers batches/s':>24} {'sampling-only batches/s':>24} "
          f"{'training only s':>16} {'epoch s':>8} {'targets/s':>10} {'trainer threads':>16} "
          f"{'epoch / training-only':>22}", flush=True)
    rows = []
    for k in counts:
        fresh = sampling_only(a, k, recycle=False) if k > 0 else float("nan")
        rate = sampling_only(a, k) if k > 0 else float("nan")
        modes: list[bool | None] = [True, False] if k > 0 and a.compare_background else [None]
        runs = {m: epoch_strategy(a, k, m) for m in modes}
        train_s: list[float] = []
        got: dict[bool | None, list[dict[str, float]]] = {m: [] for m in modes}
        for r in range(a.repeats):
            train_s.append(_train_pass(base, base_model, base_opt, kept, a.device))
            for m in modes if r % 2 == 0 else modes[::-1]:
                got[m].append(timed_epoch(*runs[m], 2 + r, a.device))
        for s, _, _ in runs.values():
            s.close()
        t = statistics.median(train_s)
        for m in modes:
            e = {key: statistics.median(x[key] for x in got[m]) for key in got[m][0]}
            label = "auto" if m is None else ("background" if m else "normal")
            rows.append({"samplers": k, "priority": label, "sampling_fresh_batches_per_s": fresh,
                         "sampling_batches_per_s": rate, "training_only_s": t, "training_only_runs": train_s,
                         "epoch_runs": [x["epoch_s"] for x in got[m]], **e})
            print(f"{k:>8} {label:>10} {fresh:>24.2f} {rate:>24.2f} {t:>16.2f} {e['epoch_s']:>8.2f} "
                  f"{targets / e['epoch_s']:>10,.0f} {int(e['trainer_threads']):>16} {e['epoch_s'] / t:>21.2f}x",
                  flush=True)
    base.close()
    print(json.dumps({"device": a.device, "targets": targets, "rows": rows}))


if __name__ == "__main__":
    main()
