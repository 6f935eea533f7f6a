"""Trainer throughput as sampler processes are added, until the trainer saturates (Armada Fig. 8).

    python -m benchmarks.bench_samplers --store STORE [--samplers 0,1,2,4,8] [--device cpu|cuda]

``--strategy mini`` (GraphSAGE, ``--fanouts``, ``--batch-size``) on ``--store``, in this process. First the
trainer's ceiling: the epoch's batches prepared beforehand and kept in memory, then trained with no preparation
(training only). Then, for each K in ``--samplers``: a warm-up epoch (worker start, compiled kernels), the
epoch's batches from K sampler processes with no model (sampling only: first with a fresh shared buffer per
batch, the producer's default and what training used before, then with recycled buffers, what training uses
now), and the timed training epoch with
``--samplers K`` (K = 0: batches prepared on the loader's thread, as ``--strategy mini`` does by default).
Printed per K: sampling-only batches per second, the epoch, training targets per second, and the epoch over the
training-only one (1.0 = the trainer is saturated; preparation is hidden). Runs one configuration at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch


def _strategy(a: argparse.Namespace, samplers: int) -> Any:
    from trellis.train.config import TrainConfig
    from trellis.train.strategies import strategy_class

    cfg = TrainConfig(store=a.store, strategy="mini", model="sage", hidden=a.hidden, fanouts=a.fanouts,
                      batch_size=a.batch_size, epochs=1, progress=False, device=a.device, prefetch=a.prefetch,
                      samplers=samplers)
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


def training_only(a: argparse.Namespace) -> tuple[float, int]:
    """Seconds to train one epoch's batches held in memory (on the device), and the epoch's targets."""
    strategy = _strategy(a, 0)
    kept = [b.to(strategy.device) for b in strategy.loader.epoch(1)]
    model, opt = _model(strategy)
    model.train()
    _train_pass(strategy, model, opt, kept, a.device)  # warms the kernels and the allocator
    seconds = _train_pass(strategy, model, opt, kept, a.device)
    targets = sum(int(b.num_targets) for b in kept)
    strategy.close()
    return seconds, targets


def sampling_only(a: argparse.Namespace, samplers: int, recycle: bool = True) -> float:
    """Batches per second that ``samplers`` processes prepare when nothing trains (consumer discards them).

    ``recycle``: workers reuse their shared buffers (what training uses); False: a fresh buffer per batch.
    """
    from trellis.loader.producer import BatchProducer, ProducerOptions

    strategy = _strategy(a, samplers)
    opts = ProducerOptions.from_flags(samplers, prefetch=max(a.prefetch, 2 * samplers), recycle=recycle)
    with BatchProducer(strategy.loader, opts).start() as prod:
        list(prod.epoch(0))  # warm-up
        t0 = time.perf_counter()
        n = sum(1 for _ in prod.epoch(1))
        seconds = time.perf_counter() - t0
    strategy.close()
    return n / seconds


def epoch_with(a: argparse.Namespace, samplers: int) -> dict[str, float]:
    """One timed training epoch with ``--samplers`` (after a warm-up epoch)."""
    strategy = _strategy(a, samplers)
    model, opt = _model(strategy)
    strategy.train_step(model, opt, strategy.task, 0)
    _sync(a.device)
    t0 = time.perf_counter()
    strategy.train_step(model, opt, strategy.task, 1)
    _sync(a.device)
    seconds = time.perf_counter() - t0
    out = {"epoch_s": seconds, "targets": strategy.last_epoch["targets"], "wait_s": strategy.last_epoch["wait_s"],
           "trainer_threads": torch.get_num_threads()}
    strategy.close()
    return out


def _build_alone(a: argparse.Namespace, shared: bool, q: Any) -> None:
    """In a fresh process: build the epoch's batches in this thread, timing sampling+gather and encoding."""
    from trellis.loader.producer import _shared_buffer, encode_batch
    from trellis.utils.numba import set_num_threads

    torch.set_num_threads(1)
    set_num_threads(1)
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
    p.add_argument("--diagnose", action="store_true",
                   help="instead: K processes building batches at once, timed in parts (no producer, no trainer)")
    a = p.parse_args(argv)
    counts = [int(k) for k in a.samplers.split(",")]
    if a.diagnose:
        diagnose(a, counts)
        return
    train_s, targets = training_only(a)
    print(f"device {a.device}, {torch.get_num_threads()} torch threads; training only (batches in memory): "
          f"{train_s:.2f} s = {targets / train_s:,.0f} targets/s", flush=True)
    print(f"{'samplers':>8} {'fresh buffers batches/s':>24} {'sampling-only batches/s':>24} {'epoch s':>8} "
          f"{'targets/s':>10} {'trainer threads':>16} "
          f"{'epoch / training-only':>22}", flush=True)
    rows = []
    for k in counts:
        fresh = sampling_only(a, k, recycle=False) if k > 0 else float("nan")
        rate = sampling_only(a, k) if k > 0 else float("nan")
        e = epoch_with(a, k)
        rows.append({"samplers": k, "sampling_fresh_batches_per_s": fresh, "sampling_batches_per_s": rate, **e})
        print(f"{k:>8} {fresh:>24.2f} {rate:>24.2f} {e['epoch_s']:>8.2f} {e['targets'] / e['epoch_s']:>10,.0f} "
              f"{e['trainer_threads']:>16} {e['epoch_s'] / train_s:>21.2f}x", flush=True)
    print(json.dumps({"device": a.device, "training_only_s": train_s, "targets": targets, "rows": rows}))


if __name__ == "__main__":
    main()
