"""Batch producers: worker processes (``--samplers``) yield exactly the batches of threads and of sequential gets."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from trellis.data.store import open_store
from trellis.errors import TrellisUserError
from trellis.loader import producer as producer_mod
from trellis.loader.blocks import Batch
from trellis.loader.cluster import ClusterLoader, hash_clusters
from trellis.loader.features import ArrayRows, FeatureGather, NormalizedRows
from trellis.loader.producer import BatchProducer, ProducerOptions, decode_batch, encode_batch, produce
from trellis.loader.sampler import LazyReverseBlock, NeighborLoader, NeighborSampler
from trellis.loader.source import iter_epoch
from trellis.ops.graph import CSRGraph

REPO = Path(__file__).resolve().parents[2]
GRAPH_FIELDS = ("indptr", "indices", "edge_weight", "edge_feat", "node_ids", "perm", "src_degree", "dst_degree",
                "edge_ids")


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None and b is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what


def same_graph(a: CSRGraph, b: CSRGraph, what: str, types: bool = True) -> None:
    assert (type(a) is type(b) or not types) and a.num_src == b.num_src, what
    for name in GRAPH_FIELDS:
        same_tensor(getattr(a, name), getattr(b, name), f"{what}.{name}")
    assert (a.rev is None) == (b.rev is None), f"{what}.rev"
    if a.rev is not None and b.rev is not None:
        assert b.rev.rev is b and a.rev.num_src == b.rev.num_src, f"{what}.rev"
        same_tensor(a.rev.indptr, b.rev.indptr, f"{what}.rev.indptr")
        same_tensor(a.rev.indices, b.rev.indices, f"{what}.rev.indices")


def same_batch(a: Batch, b: Batch, types: bool = True) -> None:
    """Every field of every block and of the batch is identical, and the same blocks are shared."""
    assert (a.num_targets, a.index, a.seed, a.stats) == (b.num_targets, b.index, b.seed, b.stats)
    for name in ("node_ids", "x", "y", "loss_mask"):
        same_tensor(getattr(a, name), getattr(b, name), name)
    assert len(a.blocks) == len(b.blocks)
    assert [[x is y for y in a.blocks] for x in a.blocks] == [[x is y for y in b.blocks] for x in b.blocks]
    for k, (p, q) in enumerate(zip(a.blocks, b.blocks)):
        same_graph(p, q, f"block {k}", types)


@pytest.fixture(scope="module")
def store(sbm_store):
    return open_store(sbm_store)


@pytest.fixture(scope="module")
def weights(store):
    return torch.from_numpy(np.random.default_rng(3).random(store.indices.shape[0]).astype(np.float32))


def neighbor(store, weights, *, labor: bool = False, batch_size: int = 97, **kw) -> NeighborLoader:
    """A loader over the store's memory maps (CSR, features), labels in memory and edge weights as a tensor."""
    sampler = NeighborSampler.from_store(store, [5, 3], labor=labor)
    return NeighborLoader(sampler, np.arange(store.num_nodes), batch_size, x=store.x, y=np.array(store.y), seed=3,
                          edge_weight=weights, **kw)


def cluster(store, weights, hops: int, **kw) -> ClusterLoader:
    n = store.num_nodes
    return ClusterLoader(store.indptr, store.indices, hash_clusters(n, 10, seed=1), 3, num_layers=2,
                         boundary_hops=hops, x=store.x, y=np.array(store.y), loss_nodes=store.split("train"),
                         edge_weight=weights, seed=5, **kw)


def check_epochs(make, workers: int, seeds=(4, 5), recycle: bool = False) -> None:
    """Processes (one pool over two epochs) == threads == sequential ``get`` on separate loader objects."""
    ref, thr = make(prefetch=0), make()
    with BatchProducer(make(), ProducerOptions("processes", workers, prefetch=2, recycle=recycle)) as prod:
        for seed in seeds:
            plan = ref.plan(seed)
            batches = prod.epoch(seed)
            threads = produce(thr, seed, ProducerOptions("threads", 1, 2))
            count = 0
            for i, (p, t) in enumerate(zip(batches, threads, strict=True)):
                same_batch(p, ref.get(plan, i))
                same_batch(p, t)
                count += 1
            assert count == len(plan) > 2
            assert batches.read_bytes >= 0 and prod.read_bytes == batches.read_bytes
        assert len(prod.pids) == workers
    assert not mp.active_children()


@pytest.mark.parametrize("labor", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_neighbor_batches_from_processes_equal_threads_and_sequential(store, weights, labor, workers):
    check_epochs(lambda **kw: neighbor(store, weights, labor=labor, **kw), workers)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")
def test_background_workers_run_at_idle_priority_and_give_the_same_batches(store, weights):
    """``background``: every worker runs under ``SCHED_IDLE`` (only CPU time nothing else wants), batches unchanged;
    without it they run at the normal policy."""
    ld, ref = neighbor(store, weights, batch_size=20), neighbor(store, weights, batch_size=20, prefetch=0)
    for background in (True, False):
        opts = ProducerOptions.from_flags(2, recycle=True, background=background)
        with BatchProducer(ld, opts) as prod:
            plan = ref.plan(3)
            assert sum(1 for i, b in enumerate(prod.epoch(3)) if same_batch(b, ref.get(plan, i)) is None) == len(plan)
            want = os.SCHED_IDLE if background else os.SCHED_OTHER
            assert [os.sched_getscheduler(pid) for pid in prod.pids] == [want, want]


def test_training_runs_samplers_in_background_only_where_they_share_the_trainers_cores(monkeypatch):
    """The trainer keeps every core (``leave_cores`` frees none): samplers in the background; else normal."""
    from trellis.train.strategies import batches as batches_mod

    seen: list[bool] = []
    real = ProducerOptions.from_flags

    def spy(*args, **kw):
        seen.append(kw.get("background", False))
        return real(*args, **kw)

    class Stub(batches_mod.BatchStrategy):
        def __init__(self) -> None:
            self.cfg = type("Cfg", (), {"samplers": 1, "prefetch": 2})()
            self.loader = object()

    class NoStart:
        def __init__(self, *a, **kw) -> None:
            pass

        def start(self):
            return self

        def epoch(self, seed):
            return []

        def close(self) -> None:
            pass

    monkeypatch.setattr(batches_mod.ProducerOptions, "from_flags", staticmethod(spy))
    monkeypatch.setattr(batches_mod, "BatchProducer", NoStart)
    threads = torch.get_num_threads()
    try:
        for have, background in ((2, True), (16, False)):
            torch.set_num_threads(have)
            stub = Stub()
            stub._epoch_batches(0)
            stub._producer = None  # (not a real producer: nothing to close)
            if stub._threads is not None:
                torch.set_num_threads(stub._threads[0])
            assert seen[-1] is background, (have, seen)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("workers", [1, 2])
def test_recycled_buffers_give_the_same_batches_in_few_slots(store, weights, workers):
    """``recycle``: batches taken one at a time equal threads' and sequential ``get``'s, epoch after epoch
    (also after an epoch closed early), while each worker reuses a handful of shared buffers."""
    check_epochs(lambda **kw: neighbor(store, weights, **kw), workers, seeds=(4, 5, 6), recycle=True)
    ld, ref = neighbor(store, weights, batch_size=20), neighbor(store, weights, batch_size=20, prefetch=0)
    with BatchProducer(ld, ProducerOptions("processes", workers, prefetch=2, recycle=True)) as prod:
        for seed in (1, 2, 3):
            with prod.epoch(seed) as batches:  # taken two, the rest dropped: their buffers go back
                for i, b in zip(range(2), batches):
                    same_batch(b, ref.get(ref.plan(seed), i))
        plan = ref.plan(9)
        for i, b in enumerate(prod.epoch(9)):
            same_batch(b, ref.get(plan, i))
        in_flight = prod.options.in_flight
        slots = [len(w.maps) for w in prod._pool.workers]
        assert len(plan) > 3 * in_flight and 1 <= max(slots) <= in_flight + 2, slots


@pytest.mark.parametrize("hops", [0, 1])
def test_cluster_batches_from_processes_equal_threads_and_sequential(store, weights, hops):
    check_epochs(lambda **kw: cluster(store, weights, hops, **kw), 2, seeds=(7,))


def test_everything_shared_through_memory_regions(store, weights, monkeypatch):
    """With every array and tensor above 0 bytes shared (not pickled), batches are still identical."""
    monkeypatch.setattr(producer_mod, "SHARE_MIN_BYTES", 1)
    ld = neighbor(store, weights, labor=True)
    ld.features.source.x = np.ascontiguousarray(ld.features.source.x)  # in memory, not a file map
    ref = neighbor(store, weights, labor=True, prefetch=0)
    plan = ref.plan(2)
    with produce(ld, 2, ProducerOptions("processes", 1)) as batches:
        for i, b in enumerate(batches):
            same_batch(b, ref.get(plan, i))


def test_sources_travel_without_their_data(store):
    """File memory maps are reopened by name, an in-memory tensor and its numpy view share one region."""
    ld = NeighborLoader(NeighborSampler.from_store(store, [5, 3]), np.arange(10), 4, x=store.x)
    mapped = store.indptr.nbytes + store.indices.nbytes + store.x.nbytes
    shared = producer_mod._Shared.dump(ld)
    try:
        assert not shared.regions and len(shared.skeleton) < mapped // 8
    finally:
        shared.close()
    x = torch.randn(store.num_nodes, 64)  # TensorRows keeps x and a numpy view of it
    ld = NeighborLoader(NeighborSampler.from_store(store, [5, 3]), np.arange(10), 4, x=x)
    shared = producer_mod._Shared.dump(ld)
    try:
        assert [n for _, n in shared.regions] == [x.numel() * 4] and len(shared.skeleton) < mapped // 8
    finally:
        shared.close()


def test_normalized_mapped_features_through_processes(store, weights):
    """The strategies' features: the store's memory map, normalized at gather (reopened, never copied)."""
    def make(**kw):
        ld = neighbor(store, weights, **kw)
        ld.features.source = NormalizedRows(ArrayRows(store.x), "row")
        return ld

    shared = producer_mod._Shared.dump(make())
    shared.close()
    assert not shared.regions
    ref = make(prefetch=0)
    plan = ref.plan(6)
    with produce(make(), 6, ProducerOptions("processes", 1)) as batches:
        for i, b in enumerate(batches):
            same_batch(b, ref.get(plan, i))


def test_rows_the_consumer_gathers_stay_out_of_the_workers(store, weights):
    """``--feature-residency device``: the workers' copy of the loader has no rows (they only sample), and the
    consumer fills each batch's rows from its own copy: the batches equal the in-process loader's."""
    x = torch.from_numpy(np.array(store.x))

    def make(**kw):
        ld = neighbor(store, weights, **kw)
        ld.features = FeatureGather(x)
        ld.features.consumer = True
        return ld

    shared = producer_mod._Shared.dump(make())
    shared.close()
    assert x.numel() * 4 not in [n for _, n in shared.regions]  # the rows never travel
    ref, loader = neighbor(store, weights, prefetch=0), make()
    with BatchProducer(loader, ProducerOptions("processes", 1, recycle=True)) as producer:
        assert producer.rows is loader.features
        for epoch in (1, 2):
            plan = ref.plan(epoch)
            with producer.epoch(epoch) as batches:
                for i, b in enumerate(batches):
                    same_batch(b, ref.get(plan, i))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_resident_rows_are_gathered_by_the_consumer(store, weights):
    ref = neighbor(store, weights, prefetch=0)
    loader = neighbor(store, weights, device="cuda")
    loader.features = FeatureGather(torch.from_numpy(np.array(store.x)).cuda())
    with produce(loader, 1, ProducerOptions("processes", 2, recycle=True)) as batches:
        plan = ref.plan(1)
        for i, b in enumerate(batches):
            assert b.x.device.type == "cuda"
            same_batch(b.to("cpu"), ref.get(plan, i), types=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loader_gets_batches_moved_after_decoding(store, weights):
    ref = neighbor(store, weights, prefetch=0)
    plan = ref.plan(1)
    with produce(neighbor(store, weights, device="cuda"), 1, ProducerOptions("processes", 1)) as batches:
        for i, b in enumerate(batches):
            assert b.x.device.type == "cuda" and b.blocks[0].indptr.device.type == "cuda"
            same_batch(b.to("cpu"), ref.get(plan, i), types=False)  # to() makes every block a CSRGraph


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loader_copies_from_page_locked_recycled_slots(store, weights):
    ref = neighbor(store, weights, prefetch=0)
    producer = BatchProducer(neighbor(store, weights, device="cuda"), ProducerOptions("processes", 2, recycle=True))
    try:
        for epoch in range(2):  # the second epoch refills the slots the first one locked
            plan = ref.plan(epoch)
            with producer.epoch(epoch) as batches:
                for i, b in enumerate(batches):
                    same_batch(b.to("cpu"), ref.get(plan, i), types=False)
            assert any(w.locked for w in producer._pool.workers)  # copies were asynchronous DMA, not staged
    finally:
        workers = producer._pool.workers
        producer.close()
    assert not any(w.locked for w in workers)  # unlocked before their memory is unmapped


def test_locked_slots_are_locked_once_and_unlocked_when_the_workers_stop(store, weights, monkeypatch):
    locks: list[int] = []
    unlocks: list[int] = []

    def lock(t):
        locks.append(t.data_ptr())
        return t.data_ptr()

    monkeypatch.setattr(producer_mod, "_page_lock", lock)  # the bookkeeping without a GPU
    monkeypatch.setattr(producer_mod, "_page_unlock", unlocks.append)
    producer = BatchProducer(neighbor(store, weights), ProducerOptions("processes", 1, recycle=True))
    with producer.epoch(0) as batches:
        n = sum(1 for _ in batches)
    workers = producer._pool.workers
    slots = list(workers[0].maps)
    assert n > len(slots) >= 1  # slots were recycled
    for _ in range(2):
        assert all(producer._pool.lock(workers[0], k) for k in slots)
    assert sorted(locks) == sorted(workers[0].maps[k].data_ptr() for k in slots)  # once per slot
    producer.close()
    assert sorted(unlocks) == sorted(locks) and not workers[0].locked


def test_encode_decode_round_trip(store, weights):
    ld = neighbor(store, weights, labor=True, prefetch=0)
    b = ld.get(ld.plan(1), 1)
    b.blocks[0].reverse()  # the lazy input block's reverse, built: carried too
    b.loss_mask = b.targets % 2 == 0
    b.stats["note"] = 3  # an int stays an int
    msg = encode_batch(b)
    assert msg.header.dtype == torch.int64 and msg.payload.dtype == torch.uint8 and msg.payload.dim() == 1
    d = decode_batch(msg)
    same_batch(d, b)
    assert isinstance(d.blocks[0], LazyReverseBlock) and type(d.blocks[1]) is CSRGraph
    assert d.blocks[0].rev is not None and d.blocks[1].rev is not None and d.blocks[1].rev.rev is d.blocks[1]
    assert type(d.stats["note"]) is int
    # aliasing survives: every block's node_ids is a prefix view of the batch's, stored once
    assert all(blk.node_ids.data_ptr() == d.node_ids.data_ptr() for blk in d.blocks)
    assert d.x.untyped_storage().data_ptr() == msg.payload.untyped_storage().data_ptr()  # views, no copy

    c = cluster(store, weights, 0, prefetch=0)
    cb = c.get(c.plan(0), 0)
    cd = decode_batch(encode_batch(cb))
    same_batch(cd, cb)
    assert cd.blocks[0] is cd.blocks[1]  # one square graph shared by both layers stays one object

    # odd tensors: empty, bool, broadcast, strided, a 0-d value; in any container
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    obj = {"empty": torch.zeros(0, 3), "mask": torch.tensor([True, False, True]), "bcast": torch.ones(3).expand(5, 3),
           "cols": base[:, ::2], "t": base.t(), "base": base, "scalar": torch.tensor(7, dtype=torch.int16)}
    back = decode_batch(encode_batch(obj))
    for k, v in obj.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and back[k].stride() == v.stride()
        assert torch.equal(back[k], v), k
    assert back["cols"].data_ptr() == back["base"].data_ptr()  # views of one tensor still share its memory


@dataclass
class ToyPlan:
    epoch: int
    n: int

    def __len__(self) -> int:
        return self.n


class ToySource:
    """Picklable by reference (this module), fails where told, sleeps to let a test act mid-epoch."""

    def __init__(self, n: int = 8, fail_at: int = -1, fail_epoch: int = 1, sleep: float = 0.0) -> None:
        self.n, self.fail_at, self.fail_epoch, self.sleep = n, fail_at, fail_epoch, sleep

    def __len__(self) -> int:
        return self.n

    def plan(self, epoch_seed: int) -> ToyPlan:
        return ToyPlan(epoch_seed, self.n)

    def get(self, plan: ToyPlan, i: int) -> dict:
        if self.sleep:
            time.sleep(self.sleep)
        if i == self.fail_at and plan.epoch == self.fail_epoch:
            raise ValueError(f"boom at {i}")
        return {"i": i, "epoch": plan.epoch, "t": torch.arange(i + plan.epoch)}


class ThreadsSource(ToySource):
    """Reports the thread counts a worker builds with, after a parallel numba kernel and a torch op."""

    def get(self, plan: ToyPlan, i: int) -> dict:
        import numpy as np

        from trellis.loader.features import gather_rows
        from trellis.utils.numba import get_num_threads

        src = np.ones((20_000, 64), dtype=np.float32)
        out = np.empty_like(src)
        gather_rows(src, np.arange(20_000, dtype=np.int64), out)  # large enough for the parallel kernel
        torch.ones(100_000).sum()
        return {"i": i, "torch": torch.get_num_threads(), "numba": get_num_threads()}


def test_workers_build_on_the_threads_they_are_given():
    """``threads_per_worker`` holds for torch as for numba. numba's threading layer, started by the worker's first
    numba call, used to reset torch's count to every core (measured: one-thread workers on all 16 cores)."""
    with BatchProducer(ThreadsSource(n=3), ProducerOptions("processes", 2, threads_per_worker=1)) as prod:
        assert [(b["torch"], b["numba"]) for b in prod.epoch(0)] == [(1, 1)] * 3


def test_worker_exception_reaches_the_consumer_in_order():
    with BatchProducer(ToySource(fail_at=3), ProducerOptions("processes", 2, prefetch=3)) as prod:
        got = []
        with pytest.raises(ValueError, match="boom at 3") as info:
            for item in prod.epoch(1):
                got.append(item["i"])
        assert got == [0, 1, 2]
        assert "test_producer.py" in str(info.value.__cause__)  # the worker's traceback
        # the pool survives a source's exception: the next epoch is whole
        again = [(item["i"], torch.equal(item["t"], torch.arange(item["i"] + 2))) for item in prod.epoch(2)]
        assert again == [(i, True) for i in range(8)]
    assert not mp.active_children()


def test_killed_worker_raises_naming_it():
    with BatchProducer(ToySource(n=200, sleep=0.02), ProducerOptions("processes", 2, prefetch=2)) as prod:
        batches = prod.epoch(0)
        next(batches)
        victim = prod.pids[1]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"pid {victim}\).*SIGKILL"):
            for _ in batches:
                pass
        assert time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="closed"):
            prod.epoch(1)
    assert not mp.active_children()


def test_silent_worker_is_declared_hung():
    opts = ProducerOptions("processes", 1, timeout_s=1.0)
    with BatchProducer(ToySource(n=3, sleep=60), opts) as prod:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"sent nothing for 1 s while building batch 0.*hung"):
            next(prod.epoch(0))
        assert time.monotonic() - t0 < 10
    assert not mp.active_children()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_early_break_and_close_leave_nothing(store, weights):
    list(produce(ToySource(n=2), 0, ProducerOptions("processes", 1)))  # the fork server runs from here on
    ld = neighbor(store, weights)
    ld.get(ld.plan(0), 0)  # the store's memory maps (one descriptor each) are open from here on
    fds, shm = _open_fds(), _shm()
    prod = BatchProducer(ld, ProducerOptions("processes", 2, prefetch=3))
    kept = []
    for i, b in enumerate(prod.epoch(0)):
        kept.append(b)  # batches outlive the producer: their memory is theirs
        if i == 1:
            break
    assert len(mp.active_children()) == 2
    prod.close()
    prod.close()  # idempotent
    assert not mp.active_children()
    assert torch.isfinite(kept[1].x).all() and kept[1].index == 1
    del kept, b
    assert _open_fds() <= fds and _shm() <= shm


def test_threads_mode_is_iter_epoch(store, weights):
    a, b = neighbor(store, weights), neighbor(store, weights)
    batches = produce(a, 3, ProducerOptions())
    for p, q in zip(batches, iter_epoch(b, 3), strict=True):
        same_batch(p, q)
    assert batches.read_bytes == 0 and batches.wait_s >= 0
    with pytest.raises(ValueError, match="slots"):
        BatchProducer(neighbor(store, weights, prefetch=1), ProducerOptions("threads", 2, prefetch=4))


def test_options_are_validated_with_the_flag():
    assert ProducerOptions.from_flags(0, prefetch=3).mode == "threads"
    opts = ProducerOptions.from_flags(4, prefetch=1)
    assert (opts.mode, opts.workers, opts.in_flight) == ("processes", 4, 4)
    with pytest.raises(TrellisUserError, match="--samplers"):
        ProducerOptions.from_flags(-1)
    with pytest.raises(TrellisUserError, match="--samplers"):
        ProducerOptions("processes", 0)
    with pytest.raises(TrellisUserError, match="--prefetch"):
        ProducerOptions("processes", 2, prefetch=-1)
    with pytest.raises(TrellisUserError, match="mode"):
        ProducerOptions("fork")
    with pytest.raises(TrellisUserError, match="fork is unsafe"):
        ProducerOptions("processes", 1, start_method="fork")


def test_workers_stop_at_interpreter_exit(tmp_path):
    """A producer nobody closes: its workers are gone once the interpreter has exited."""
    script = tmp_path / "leak.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.loader.test_producer import ToySource
        from trellis.loader.producer import BatchProducer, ProducerOptions

        if __name__ == "__main__":
            prod = BatchProducer(ToySource(), ProducerOptions("processes", 2))
            it = prod.epoch(0)
            next(it)
            print(*prod.pids, flush=True)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
