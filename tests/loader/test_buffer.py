"""The partition buffer's pieces: the epoch's buffer states, the state graph, reads, inclusion probabilities."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.loader.buffer import (
    DIRECT_BLOCK,
    KEPT_LEVELS,
    NPY_HEADER,
    PartitionBuffer,
    PartRows,
    buffer_states,
    direct_slot_stride,
    inclusion_probability,
    read_npy,
    read_npy_direct,
    state_graph,
)
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.partition import partition_graph
from trellis.partition.layout import PartitionedGraph, write_layout


@pytest.fixture(scope="module")
def layout(sbm_store: Path, tmp_path_factory: pytest.TempPathFactory) -> PartitionedGraph:
    store = GraphStore(sbm_store)
    book = partition_graph(store, "metis", 4, measure=False)
    return PartitionedGraph(write_layout(store, book, tmp_path_factory.mktemp("buf") / "p4"))


@pytest.mark.parametrize("parts,capacity", [(1, 1), (4, 1), (4, 2), (8, 3), (8, 8)])
def test_states_read_each_part_once_and_target_each_node_once(parts, capacity):
    rng = np.random.default_rng(3)
    part_of_node = rng.integers(0, parts, 1000)
    order = rng.permutation(1000)
    states = buffer_states(parts, capacity, part_of_node[order], order, np.random.default_rng(5))
    assert len(states) == parts - capacity + 1
    reads = list(states[0].parts) + [s.enters for s in states[1:]]
    assert sorted(reads) == list(range(parts))  # every part read exactly once
    for s in states:
        assert len(s.parts) == capacity
        assert np.isin(part_of_node[s.targets], s.parts).all()  # a target is trained while its part is resident
    got = np.concatenate([s.targets for s in states])
    assert np.array_equal(np.sort(got), np.arange(1000))  # every target exactly once
    for s in states:  # inside a state, the epoch permutation's order
        pos = np.argsort(order)[s.targets]
        assert np.all(np.diff(pos) > 0)


def test_state_graph_keeps_available_sources_in_stored_order():
    # 5 nodes; part A holds rows 0, 2; part B row 4; the cache holds row 1 (and row 2, which A holds)
    a = PartRows(0, np.array([0, 2]), np.array([0, 3, 5]), np.array([1, 3, 4, 0, 3]), np.array([10, 11, 12, 13, 14]))
    b = PartRows(1, np.array([4]), np.array([0, 2]), np.array([2, 3]), np.array([20, 21]))
    cache = PartRows(-1, np.array([1, 2]), np.array([0, 1, 2]), np.array([0, 4]), np.array([30, 31]))
    avail = np.array([True, True, True, False, True])
    in_parts = np.array([True, False, True, False, True])
    ip, ix, eid, kept, total = state_graph(5, [a, b, cache], avail, in_parts)
    assert ip.tolist() == [0, 2, 3, 4, 4, 5]
    assert ix.tolist() == [1, 4, 0, 0, 2]
    assert eid.tolist() == [10, 12, 30, 13, 20]
    assert (kept, total) == (5, 9)


def test_read_npy_sequential_and_checked(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "a.npy", a)
    out = np.zeros((6, 3), dtype=np.float32)
    read_npy(tmp_path / "a.npy", out)
    assert np.array_equal(out[:4], a) and not out[4:].any()
    with pytest.raises(TrellisUserError, match="fit the buffer"):
        read_npy(tmp_path / "a.npy", np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(TrellisUserError, match="missing"):
        read_npy(tmp_path / "b.npy")
    (tmp_path / "c.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:-8])
    with pytest.raises(TrellisUserError, match="truncated"):
        read_npy(tmp_path / "c.npy")


@pytest.mark.parametrize(("rows", "width"), [(1000, 128), (777, 3), (5, 100)])
def test_direct_read_lands_a_part_in_its_slot_and_leaves_the_neighbouring_slots_alone(tmp_path, rows, width):
    """One O_DIRECT read per part file into slots of ``direct_slot_stride``: every slot aligned as the first, the
    header and the block's tail written into slack only; where O_DIRECT cannot serve, nothing is read."""
    row_bytes = width * 4
    stride = direct_slot_stride(rows, row_bytes)
    assert stride * row_bytes % DIRECT_BLOCK == 0 and (stride - rows) * row_bytes >= 2 * DIRECT_BLOCK
    raw = np.empty(3 * stride * row_bytes + 2 * DIRECT_BLOCK, dtype=np.uint8)
    first = (NPY_HEADER - raw.ctypes.data) % DIRECT_BLOCK + DIRECT_BLOCK
    arena = raw[first: first + 3 * stride * row_bytes].view(np.float32).reshape(3 * stride, width)
    arena[:] = -1.0
    parts = [np.random.default_rng(k).standard_normal((rows - k, width)).astype(np.float32) for k in range(3)]
    for k, part in enumerate(parts):
        np.save(tmp_path / f"x{k}.npy", part)
        assert (tmp_path / f"x{k}.npy").stat().st_size == NPY_HEADER + part.nbytes
    order = [1, 0, 2]  # slot k takes part order[k] (the middle slot has full neighbours on both sides)
    direct = [read_npy_direct(tmp_path / f"x{p}.npy", raw, first + k * stride * row_bytes,
                              arena[k * stride: k * stride + parts[p].shape[0]]) for k, p in enumerate(order)]
    if not any(direct):  # a file system without O_DIRECT (tmpfs): the buffered path reads instead
        pytest.skip("O_DIRECT is refused on this file system")
    assert all(direct)
    for k, p in enumerate(order):
        assert np.array_equal(arena[k * stride: k * stride + parts[p].shape[0]], parts[p])
    # a misaligned destination is refused with nothing read
    out = arena[1: 1 + parts[0].shape[0]]
    out[:] = -1.0
    assert not read_npy_direct(tmp_path / "x0.npy", raw, first + row_bytes, out) or row_bytes % DIRECT_BLOCK == 0
    if row_bytes % DIRECT_BLOCK:
        assert (out == -1.0).all()
    with pytest.raises(TrellisUserError, match="fit the buffer"):
        read_npy_direct(tmp_path / "x0.npy", raw, first, arena[: rows - 1])
    with pytest.raises(TrellisUserError, match="missing"):
        read_npy_direct(tmp_path / "none.npy", raw, first, arena[:rows])


def test_inclusion_probability_matches_simulation():
    # a star: node 0 <- 1..9 (in-edges), targets {0}; fanout 3 of 9 -> each leaf with probability 1/3
    rows = np.array([0])
    piece = PartRows(0, rows, np.array([0, 9]), np.arange(1, 10), np.arange(9))
    prob = inclusion_probability(lambda: iter([piece]), 10, np.array([9] + [0] * 9), np.array([0]), [3], 1)
    assert prob[0] == 0.0
    np.testing.assert_allclose(prob[1:], 1 / 3)


def test_all_parts_resident_gives_the_mini_batches(layout, sbm_store):
    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    y = torch.from_numpy(np.array(store.y, dtype=np.int64))
    buf = PartitionBuffer(layout, 4, [4, 3], train, 32, y=y, degree=degree, seed=0, prefetch=0)
    loader = NeighborLoader(NeighborSampler(store.indptr, store.indices, [4, 3]), train, 32, x=np.asarray(store.x),
                            y=y, seed=0, prefetch=0)
    try:
        ours = list(buf.epoch(7))
        ref = list(loader.epoch(7))
        assert len(ours) == len(ref)
        for a, b in zip(ours, ref):
            assert torch.equal(a.node_ids, b.node_ids) and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
            for ba, bb in zip(a.blocks, b.blocks):
                assert torch.equal(ba.indptr, bb.indptr) and torch.equal(ba.indices, bb.indices)
                assert torch.equal(ba.src_degree, bb.src_degree)
    finally:
        buf.close()


@pytest.mark.parametrize("capacity,cache", [(1, 0), (2, 0), (2, 100)])
def test_buffer_batches_only_read_resident_rows(layout, sbm_store, capacity, cache):
    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    x = np.asarray(store.x)
    buf = PartitionBuffer(layout, capacity, [5, 5], train, 16, y=None, degree=degree, cache_rows=cache, prefetch=1)
    try:
        seen = []
        for batch in buf.epoch(1):
            assert torch.equal(batch.x, torch.from_numpy(x[batch.node_ids.numpy()]))  # the right rows
            seen.append(batch.targets.numpy())
        assert np.array_equal(np.sort(np.concatenate(seen)), np.sort(train))
        st = buf.stats
        assert st.parts_loaded == 4 and st.states == 4 - capacity + 1
        assert (st.cache_inputs > 0) == (cache > 0)
        carry = buf.carry
        assert carry is not None and len(carry) == capacity  # the next epoch starts from the last state
        again = [b.node_ids.clone() for b in buf.epoch(1)]  # the same seed and first state, the same batches
        assert buf.stats.parts_loaded == 4 - capacity  # the carried state is not read again
        buf.carry = carry
        first = [b.node_ids for b in buf.epoch(1)]
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    finally:
        buf.close()


def test_a_held_batch_keeps_its_rows_while_the_producer_runs_ahead(layout, sbm_store):
    """Rows of a batch the consumer holds are not overwritten by batches prepared ahead of it.

    Small states (capacity 2 of 4 parts, 16 targets a step) make steps that span states, whose pieces are not
    yielded: the consumer waits on each batch until the producer has gone as far as the prefetch lets it,
    then checks the rows (the rotating gather buffers were indexed by batch index, which skips over pieces).
    """
    import time

    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    x = np.asarray(store.x)
    buf = PartitionBuffer(layout, 2, [5, 5], train, 16, y=None, degree=degree, prefetch=1)
    try:
        spans = 0
        for ep in range(3):
            spans += sum(not cut[2] for st in buf.plan(ep).states for cut in st.cuts)
            for batch in buf.epoch(ep):
                time.sleep(0.1)  # the producer fills the queue and builds the next batches meanwhile
                assert torch.equal(batch.x, torch.from_numpy(x[batch.node_ids.numpy()])), (ep, batch.index)
        assert spans >= 3  # the case is exercised: steps span states
    finally:
        buf.close()


def test_a_step_that_spans_states_is_one_batch(layout, sbm_store):
    """Steps are cut from the epoch's targets in state order; one that crosses a swap is sampled in each state
    and trained as one batch: every batch is a whole step of ``batch_size`` targets (the last one the rest),
    with the rows and labels of its targets, each trained once."""
    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    x, y = np.asarray(store.x), torch.from_numpy(np.array(store.y))
    buf = PartitionBuffer(layout, 1, [5, 5], train, 24, y=y, degree=degree, prefetch=1)
    try:
        plan = buf.plan(2)
        assert any(not cut[2] for st in plan.states for cut in st.cuts)  # some step does span states
        batches = list(buf.epoch(2))
        sizes = [b.num_targets for b in batches]
        assert sizes == [24] * (len(train) // 24) + ([len(train) % 24] if len(train) % 24 else [])
        assert all(b.step_end and b.step_weight == 1.0 for b in batches)
        for b in batches:
            assert torch.equal(b.x, torch.from_numpy(x[b.node_ids.numpy()])) and torch.equal(b.y, y[b.targets])
        got = np.concatenate([b.targets.numpy() for b in batches])
        assert np.array_equal(np.sort(got), np.sort(train))
    finally:
        buf.close()


@pytest.mark.parametrize("collapsed", [False, True])
def test_replay_rehearses_the_parts_not_resident(layout, sbm_store, collapsed):
    """After each step's last batch comes one batch of every part not resident (their kept batches side by
    side, 4-bit rows), weighted as those parts' share; they are not targets of the epoch (every training node
    is still a target exactly once), and they survive a checkpoint. Collapsed (the model's first layer is
    pushed down), a kept batch holds its first hop's rows and their aggregations instead of its input rows."""
    from trellis.nn import build_model
    from trellis.nn.models import input_aggregation

    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    x, y = np.asarray(store.x), torch.from_numpy(np.array(store.y))
    part_of = np.asarray(np.load(layout.path / "node_parts.npy"))
    buf = PartitionBuffer(layout, 2, [5, 5], train, 16, y=y, degree=degree, prefetch=1, replay=4)
    if collapsed:
        buf.collapse = input_aggregation(build_model("sage", x.shape[1], 4, hidden=8))
    try:
        targets, rehearsed = [], 0
        resident: set[int] = set()
        plan = buf.plan(1)
        state_of = np.full(len(part_of), -1)
        for k, st in enumerate(plan.states):
            state_of[st.targets] = k
        for batch in buf.epoch(1):
            want = torch.from_numpy(x[batch.node_ids.numpy()])
            if not batch.replay:
                assert torch.equal(batch.x, want)  # the right rows
                targets.append(batch.targets.numpy())
                # a step that spans states is one batch; it ends in the state of its last target
                resident = set(plan.states[state_of[int(batch.targets[-1])]].parts)
                continue
            # kept in 4 bits: within half a quantization step (a row's largest |value| / KEPT_LEVELS)
            step = want.abs().amax(dim=1, keepdim=True) / KEPT_LEVELS
            assert torch.all((batch.x - want).abs() <= step / 2 + 1e-5)
            first = batch.blocks[0]
            assert (first.fixed_aggregation is not None) == collapsed
            if collapsed:  # the input block has no edges; its sources are its destinations, aggregated
                assert first.num_edges == 0 and first.num_src == first.num_dst == batch.num_inputs
                assert first.fixed_aggregation.shape == (first.num_dst, x.shape[1])
                # a mean of rows lies within their range (up to a half quantization step)
                assert float(first.fixed_aggregation.abs().max()) <= float(np.abs(x).max()) * (1 + 0.5 / KEPT_LEVELS)
            rehearsed += 1
            # sampled at the rehearsal fanouts: the target layer's halved (5 -> 3)
            assert buf.replay_fanouts == [3, 5] and int(torch.diff(batch.blocks[-1].indptr).max()) <= 3
            parts = set(part_of[batch.targets.numpy()].tolist())
            assert parts and not parts & resident and batch.num_targets <= 4 * len(parts)
            assert batch.step_end and batch.step_weight == len(parts) / 2 and torch.equal(batch.y, y[batch.targets])
        assert np.array_equal(np.sort(np.concatenate(targets)), np.sort(train))
        assert rehearsed > 0
        state = buf.state_dict()  # the carry and the rehearsal batches, as a checkpoint holds them
        assert len(state["pool"]) == 4
        kept = [c for chunks in buf.pool.values() for c in chunks]
        assert all(c.q.dtype == torch.uint8 and c.q.shape[1] == (x.shape[1] + 1) // 2 for c in kept)  # two per byte
        assert all(c.collapsed == collapsed and c.q.shape[0] == c.batch.node_ids.shape[0] * (1 + collapsed)
                   for c in kept)
        assert buf.stats.extra["replay_rows"] == sum(c.q.shape[0] for c in kept)
        assert buf.stats.extra["replay_bytes"] == sum(c.nbytes for c in kept) > buf.stats.extra["replay_rows"] * 8
        def seen(b):
            fixed = b.blocks[0].fixed_aggregation
            return b.replay, b.node_ids.clone(), b.x.clone(), b.step_weight, None if fixed is None else fixed.clone()

        again = [seen(b) for b in buf.epoch(1)]
        buf.load_state_dict(state)  # a resumed run: the same epoch, rehearsals included
        first = [seen(b) for b in buf.epoch(1)]
        assert len(again) == len(first)
        assert all(a[0] == b[0] and a[3] == b[3] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
                   and (a[4] is None and b[4] is None or torch.equal(a[4], b[4])) for a, b in zip(again, first))
    finally:
        buf.close()


def test_rehearsal_fanouts(layout, sbm_store):
    """Rehearsal batches take their own fanouts (default: the target layer's halved, -1 kept); live ones the run's."""
    from trellis.loader.buffer import default_replay_fanouts

    assert default_replay_fanouts([10, 5]) == [5, 5]
    assert default_replay_fanouts([15, 10, 5]) == [8, 10, 5]
    assert default_replay_fanouts([1, 3]) == [1, 3]
    assert default_replay_fanouts([-1, 4]) == [-1, 4]
    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    buf = PartitionBuffer(layout, 1, [6, 4], train, 16, y=torch.from_numpy(np.array(store.y)), degree=degree,
                          prefetch=1, replay=8, replay_fanouts=[1, 2])
    try:
        most = {True: 0, False: 0}
        for batch in buf.epoch(0):
            degs = [int(torch.diff(b.indptr).max()) for b in batch.blocks]
            most[batch.replay] = max(most[batch.replay], degs[-1])
            assert degs[-1] <= (1 if batch.replay else 6) and degs[0] <= (2 if batch.replay else 4)
        assert most == {True: 1, False: 6}  # both drawn at their full fanout somewhere
    finally:
        buf.close()
    with pytest.raises(ValueError, match="one per layer"):
        PartitionBuffer(layout, 1, [6, 4], train, 16, y=None, degree=degree, replay=8, replay_fanouts=[1])


@pytest.mark.parametrize("width", [1, 5, 16])
def test_kept_rows_round_trip_in_4_bits(width):
    """Kept rows (odd widths too) come back within half a step of each row's largest |value|; zero rows exactly."""
    from trellis.loader.blocks import Batch
    from trellis.loader.buffer import Kept

    rng = np.random.default_rng(width)
    rows = (rng.standard_normal((9, width)) * rng.uniform(0.1, 50, (9, 1))).astype(np.float32)
    rows[3] = 0.0
    ids = torch.arange(9)
    kept = Kept.of(Batch(blocks=[], node_ids=ids, num_targets=9), rows, edge_ids=False)
    assert kept.q.dtype == torch.uint8 and kept.q.shape == (9, (width + 1) // 2)
    back = kept.rows().numpy()
    step = np.abs(rows).max(axis=1, keepdims=True) / KEPT_LEVELS
    assert back.shape == rows.shape and np.all(np.abs(back - rows) <= step / 2 + 1e-5)
    assert np.array_equal(back[3], rows[3])
    out = np.full((12, width), 7.0, dtype=np.float32)  # written into chosen rows of a larger array
    at = np.array([11, 0, 2, 3, 4, 5, 6, 7, 9])
    kept.rows(out, at)
    assert np.array_equal(out[at], back) and np.all(out[[1, 8, 10]] == 7.0)


@pytest.mark.parametrize("sizes,batch", [([10], 4), ([3, 5, 0, 9], 4), ([2, 2, 2], 8), ([7, 1], 1)])
def test_steps_span_states(sizes, batch):
    """An epoch takes ceil(T / B) optimizer steps of B targets, whichever states they come from."""
    from trellis.loader.buffer import BufferState, cut_steps

    states = [BufferState((0,), None, None, np.arange(n)) for n in sizes]
    cut_steps(states, batch)
    cuts = [c for s in states for c in s.cuts]
    total = sum(sizes)
    assert sum(c[2] for c in cuts) == -(-total // batch)  # steps
    weight = 0.0
    for lo, hi, end, w in cuts:
        assert hi > lo and 0 < w <= 1
        weight += w
        if end:
            assert weight == pytest.approx(1.0)
            weight = 0.0
    if len(sizes) == 1:
        assert all(c[3] == 1.0 and c[2] for c in cuts)  # one state: mini's batches


@pytest.mark.parametrize("capacity,cache", [(4, 0), (1, 0), (2, 60)])
def test_layerwise_inference_over_the_buffer(layout, sbm_store, tmp_path, capacity, cache):
    """All parts resident: exact layer-wise inference; fewer: the same shapes, each row computed once."""
    from trellis.loader.buffer_inference import buffer_inference
    from trellis.loader.inference import layerwise_inference
    from trellis.nn.models import build_model

    store = GraphStore(sbm_store)
    train = np.asarray(store.split("train"), dtype=np.int64)
    degree = np.diff(np.asarray(store.indptr)).astype(np.float32)
    torch.manual_seed(0)
    model = build_model("sage", 16, 4, hidden=8, layers=2, dropout=0.0)
    ref = layerwise_inference(model, store.indptr, store.indices, torch.from_numpy(np.array(store.x)))
    buf = PartitionBuffer(layout, capacity, [5, 5], train, 16, y=None, degree=degree, cache_rows=cache, prefetch=0)
    try:
        rows = np.arange(0, store.num_nodes, 3)
        got = buffer_inference(model, buf, tmp_path, rows=rows)
        assert got.shape == (rows.shape[0], 4)
        if capacity == 4:
            torch.testing.assert_close(got, ref[rows], rtol=1e-5, atol=1e-6)
        else:
            assert not torch.allclose(got, ref[rows])  # neighbours outside the buffer are left out
        assert len(list(buf.epoch(0))) > 0  # training goes on after an evaluation
    finally:
        buf.close()


def test_state_graphs_reuse_their_arrays_without_leaking_counts():
    from trellis.loader.buffer import StateGraphs

    a = PartRows(0, np.array([0, 2]), np.array([0, 3, 5]), np.array([1, 3, 4, 0, 3]), np.array([10, 11, 12, 13, 14]))
    b = PartRows(1, np.array([4]), np.array([0, 2]), np.array([2, 3]), np.array([20, 21]))
    avail = np.ones(5, dtype=bool)
    skip = np.zeros(5, dtype=bool)
    builder = StateGraphs(5)
    for pieces in ([a, b], [b], [a], [a, b]):
        got = builder.build(pieces, avail, skip)
        ref = state_graph(5, pieces, avail, skip)
        assert all(np.array_equal(x, y) for x, y in zip(got[:3], ref[:3])) and got[3:] == ref[3:]


def test_evaluation_chunks_stay_within_their_bytes():
    from trellis.loader.buffer_inference import EDGE_BYTES, OUT_COPIES, chunk_cuts

    deg = np.random.default_rng(0).integers(0, 50, 10_000)
    cuts = chunk_cuts(deg, 64, 32, 1 << 20)
    assert cuts[0] == 0 and cuts[-1] == deg.shape[0] and (np.diff(cuts) > 0).all()
    cost = (deg + 1) * (64 * 4 + EDGE_BYTES) + 32 * 4 * OUT_COPIES
    per_chunk = np.add.reduceat(cost, cuts[:-1])
    single = np.diff(cuts) == 1
    assert (per_chunk[~single] <= (1 << 20) + cost.max()).all()  # a row more at most
    assert len(cuts) - 1 >= cost.sum() // (1 << 20)
    assert np.array_equal(chunk_cuts(deg, 64, 32, None), [0, deg.shape[0]])  # edges only: one chunk here
