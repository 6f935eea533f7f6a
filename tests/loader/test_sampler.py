import numpy as np
import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.loader.blocks import check_nested, parse_fanouts
from trellis.loader.features import FeatureGather
from trellis.loader.sampler import NeighborLoader, NeighborSampler, reverse_csr, split_batch

from .conftest import random_csr


def edge_set(indptr, indices):
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    return set(zip(dst.tolist(), indices.tolist()))


def block_global_edges(block):
    ids = block.node_ids.numpy()
    ip, ix = block.indptr.numpy(), block.indices.numpy()
    dst = np.repeat(np.arange(block.num_dst), np.diff(ip))
    return ids[dst], ids[ix]


@pytest.mark.parametrize("labor", [False, True])
@pytest.mark.parametrize("fanouts", [[5, 3], [-1, 4], [2, 2, 2]])
def test_sampled_edges_exist_nested_and_unique(csr, fanouts, labor):
    indptr, indices = csr
    edges = edge_set(indptr, indices)
    s = NeighborSampler(indptr, indices, fanouts, labor=labor)
    seeds = np.random.default_rng(1).choice(len(indptr) - 1, 40, replace=False)
    b = s.sample(seeds, 7)
    assert len(b.blocks) == len(fanouts)
    check_nested(b.blocks)
    assert np.array_equal(b.targets.numpy(), seeds)
    assert b.blocks[-1].num_dst == len(seeds)
    assert len(np.unique(b.node_ids.numpy())) == b.num_inputs
    for blk in b.blocks:
        # destinations are the first sources, local ids index a prefix of node_ids
        assert torch.equal(blk.node_ids, b.node_ids[: blk.num_src])
        d, src = block_global_edges(blk)
        assert set(zip(d.tolist(), src.tolist())) <= edges
        # eid points at the very edge that was sampled
        eid = blk.edge_ids.numpy()
        assert np.array_equal(indices[eid], src)
        assert np.array_equal(np.searchsorted(indptr, eid, side="right") - 1, d)
        # no duplicate edge per destination
        pairs = d * (len(indptr) - 1) + src
        assert len(np.unique(pairs)) == len(pairs)


@pytest.mark.parametrize("fanouts", [[5, 3], [1, 50], [-1, -1]])
def test_fanouts_respected(csr, fanouts):
    indptr, indices = csr
    deg = np.diff(indptr)
    s = NeighborSampler(indptr, indices, fanouts)
    b = s.sample(np.arange(0, 300, 3), 0)
    for blk, f in zip(b.blocks, reversed(fanouts)):
        got = np.diff(blk.indptr.numpy())
        d = deg[blk.node_ids.numpy()[: blk.num_dst]]
        want = d if f < 0 else np.minimum(d, f)
        assert np.array_equal(got, want)


def test_all_neighbors_is_whole_neighborhood(csr):
    indptr, indices = csr
    b = NeighborSampler(indptr, indices, [-1]).sample(np.array([3, 10, 11]), 0)
    d, src = block_global_edges(b.blocks[0])
    for v in (3, 10, 11):
        assert sorted(src[d == v]) == sorted(indices[indptr[v]:indptr[v + 1]])


def test_deterministic_from_seed_and_thread_count(csr):
    import numba

    indptr, indices = csr
    seeds = np.arange(5, 105)
    s = NeighborSampler(indptr, indices, [4, 3])
    a = s.sample(seeds, 123)
    b = NeighborSampler(indptr, indices, [4, 3]).sample(seeds, 123)
    old = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        c = s.sample(seeds, 123)
    finally:
        numba.set_num_threads(old)
    for other in (b, c):
        assert torch.equal(a.node_ids, other.node_ids)
        for x, y in zip(a.blocks, other.blocks):
            assert torch.equal(x.indptr, y.indptr) and torch.equal(x.indices, y.indices)
    d = s.sample(seeds, 124)
    assert not torch.equal(a.node_ids, d.node_ids)


def test_parallel_path_matches_serial(monkeypatch):
    from trellis.loader import sampler as S

    indptr, indices = random_csr(n=3000, avg_deg=12, seed=3)
    seeds = np.arange(0, 3000, 2)
    for labor in (False, True):
        a = S.NeighborSampler(indptr, indices, [6, 4], labor=labor).sample(seeds, 9)
        monkeypatch.setattr(S, "PARALLEL_MIN_WORK", 1 << 62)
        b = S.NeighborSampler(indptr, indices, [6, 4], labor=labor).sample(seeds, 9)
        monkeypatch.setattr(S, "PARALLEL_MIN_WORK", 20_000)
        assert torch.equal(a.node_ids, b.node_ids)
        assert all(torch.equal(x.indices, y.indices) for x, y in zip(a.blocks, b.blocks))


def test_uniform_sampling_is_unbiased():
    # one destination with 20 in-neighbours, pick 5: every neighbour ~ 1/4 of the time
    indptr = np.array([0, 20] + [20] * 20, dtype=np.int64)
    indices = np.arange(1, 21, dtype=np.int64)
    s = NeighborSampler(indptr, indices, [5])
    counts = np.zeros(21)
    trials = 2000
    for t in range(trials):
        b = s.sample(np.array([0]), t)
        counts[b.node_ids.numpy()[1:]] += 1
    freq = counts[1:] / trials
    assert np.all(np.abs(freq - 0.25) < 0.05)


def test_labor_expected_fanout_and_fewer_inputs():
    indptr, indices = random_csr(n=2000, avg_deg=40, seed=5, hubs=False)
    seeds = np.arange(0, 2000, 4)
    deg = np.diff(indptr)[seeds]
    per_dst = []
    inputs = {False: [], True: []}
    for t in range(20):
        for labor in (False, True):
            b = NeighborSampler(indptr, indices, [10], labor=labor).sample(seeds, t)
            inputs[labor].append(b.num_inputs)
            if labor:
                per_dst.append(np.diff(b.blocks[0].indptr.numpy()))
    mean = np.mean(per_dst, axis=0)
    expect = np.minimum(deg, 10)
    assert abs(mean.mean() - expect.mean()) < 0.3
    assert np.mean(inputs[True]) < np.mean(inputs[False])


def test_reverse_csr_kernel(csr):
    indptr, indices = csr
    rip, rix, perm = reverse_csr(indptr, indices, len(indptr) - 1)
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    # reverse edge k is forward edge perm[k]: same endpoints
    src_of_rev = np.repeat(np.arange(len(rip) - 1), np.diff(rip))
    assert np.array_equal(indices[perm], src_of_rev)
    assert np.array_equal(dst[perm], rix)


def test_blocks_carry_reverse_and_degrees(csr):
    indptr, indices = csr
    b = NeighborSampler(indptr, indices, [3, 3]).sample(np.arange(10), 0)
    deg = np.diff(indptr).astype(np.float32)
    assert b.blocks[0].rev is None  # the input block's reverse is built on first use
    for blk in b.blocks:
        rev = blk.reverse()
        assert blk.perm is not None and rev.num_dst == blk.num_src and rev.num_edges == blk.num_edges
        assert torch.equal(blk.indices[blk.perm], torch.repeat_interleave(torch.arange(blk.num_src),
                                                                        rev.indptr[1:] - rev.indptr[:-1]))
        assert np.array_equal(blk.src_degree.numpy(), deg[blk.node_ids.numpy()])
        assert blk.dst_degree.shape[0] == blk.num_dst


@pytest.mark.parametrize("model_name,layers", [("sage", 2), ("gcn", 3), ("gat", 2)])
def test_merged_batches_compute_as_each_alone(csr, model_name, layers):
    """Batches merged side by side give every target the logits (and the weights the gradients) it gets in its
    own batch, though a node may appear in several of them; edge ids and rows are carried over."""
    from trellis.nn import build_model

    indptr, indices = csr
    sampler = NeighborSampler(indptr, indices, [4, 3, 2][:layers])
    x_all = torch.randn(len(indptr) - 1, 6, generator=torch.Generator().manual_seed(0))
    batches = [sampler.sample(np.array(t), s) for t, s in (([0, 3, 5], 1), ([3, 7], 2), ([11, 12, 13, 40], 3))]
    for b in batches:
        b.x = x_all[b.node_ids]
    merged = sampler.merge(batches)
    assert merged.num_targets == 9 and torch.equal(merged.targets, torch.tensor([0, 3, 5, 3, 7, 11, 12, 13, 40]))
    assert torch.equal(merged.x, x_all[merged.node_ids])
    assert merged.num_edges == sum(b.num_edges for b in batches)
    for blk in merged.blocks:  # every edge is a real in-edge, its id the CSR's
        dst = np.repeat(blk.node_ids.numpy()[:blk.num_dst], np.diff(blk.indptr.numpy()))
        src = blk.node_ids.numpy()[blk.indices.numpy()]
        assert np.array_equal(indices[blk.edge_ids.numpy()], src)
        assert np.all((indptr[dst] <= blk.edge_ids.numpy()) & (blk.edge_ids.numpy() < indptr[dst + 1]))
    torch.manual_seed(0)
    model = build_model(model_name, 6, 3, hidden=5, layers=layers, dropout=0.0).eval()
    out = model(merged.graph, merged.x)
    out.square().sum().backward()
    merged_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = [model(b.graph, b.x) for b in batches]
    torch.cat(alone).square().sum().backward()
    assert torch.allclose(out, torch.cat(alone), atol=1e-6)
    assert all(torch.allclose(a, p.grad, atol=1e-5) for a, p in zip(merged_grads, model.parameters()))


@pytest.mark.parametrize("model_name,layers", [("sage", 2), ("gcn", 3)])
def test_split_batches_compute_as_the_batch(csr, model_name, layers):
    """A batch split into sub-batches of its targets: each keeps exactly its targets' sampled neighbourhood
    (every edge one of the batch's, with its id), so its targets get the batch's logits."""
    from trellis.nn import build_model

    indptr, indices = csr
    sampler = NeighborSampler(indptr, indices, [4, 3, 2][:layers], degrees=np.diff(indptr).astype(np.float32))
    x_all = torch.randn(len(indptr) - 1, 6, generator=torch.Generator().manual_seed(0))
    batch = sampler.sample(np.array([40, 3, 17, 5, 0, 22, 9]), 4)
    batch.x = x_all[batch.node_ids]
    cuts = [(0, 3), (3, 4), (4, 7)]
    subs = split_batch(batch, cuts)
    torch.manual_seed(0)
    model = build_model(model_name, 6, 3, hidden=5, layers=layers, dropout=0.0).eval()
    want = model(batch.graph, batch.x)
    pairs = {(int(e), int(d)) for g in batch.blocks
             for d, e in zip(np.repeat(g.node_ids.numpy()[:g.num_dst], np.diff(g.indptr.numpy())),
                             g.edge_ids.numpy())}
    for (lo, hi), (sub, at) in zip(cuts, subs):
        assert torch.equal(sub.targets, batch.targets[lo:hi]) and torch.equal(sub.node_ids, batch.node_ids[at])
        check_nested(sub.blocks)
        for g in sub.blocks:  # every edge is one of the batch's edges, into the same destination
            dst = np.repeat(g.node_ids.numpy()[:g.num_dst], np.diff(g.indptr.numpy()))
            assert {(int(e), int(d)) for d, e in zip(dst, g.edge_ids.numpy())} <= pairs
            assert np.array_equal(indices[g.edge_ids.numpy()], g.node_ids.numpy()[g.indices.numpy()])
        sub.x = x_all[sub.node_ids]
        alone = sampler.merge([sub])  # the degrees and reverse graphs a trained batch has
        assert torch.allclose(model(alone.graph, alone.x), want[lo:hi], atol=1e-6)


def test_bad_input(csr):
    indptr, indices = csr
    with pytest.raises(TrellisUserError, match="--layers 3"):
        parse_fanouts("15,10", 3)
    with pytest.raises(TrellisUserError):
        parse_fanouts("15,0")
    with pytest.raises(TrellisUserError):
        parse_fanouts("a,b")
    s = NeighborSampler(indptr, indices, [2])
    with pytest.raises(TrellisUserError, match="batch-size"):
        NeighborLoader(s, np.arange(10), 0)
    with pytest.raises(ValueError, match="unique"):
        s.sample(np.array([1, 1]), 0)
    # the scratch map was reset despite the error
    assert s.sample(np.array([1, 2]), 0).num_targets == 2


def test_feature_gather_reuses_buffers():
    x = np.random.default_rng(0).standard_normal((50, 6)).astype(np.float32)
    fg = FeatureGather(x, slots=2)
    a = fg.gather(np.array([3, 1, 4]), 0)
    assert np.array_equal(a.numpy(), x[[3, 1, 4]])
    b = fg.gather(np.array([5, 9]), 2)  # slot 2 % 2 == 0: same storage as a
    assert a.data_ptr() == b.data_ptr()
    assert np.array_equal(b.numpy(), x[[5, 9]])
    t = FeatureGather(torch.from_numpy(x)).gather(torch.tensor([7, 8]))
    assert torch.equal(t, torch.from_numpy(x[[7, 8]]))


def test_loader_epochs_cover_ids_and_are_reproducible(csr):
    indptr, indices = csr
    x = np.arange(300 * 2, dtype=np.float32).reshape(300, 2)
    y = np.arange(300) % 3
    ids = np.arange(0, 300, 2)
    s = NeighborSampler(indptr, indices, [3, 2])
    ld = NeighborLoader(s, ids, 32, x=x, y=y, seed=5, prefetch=0)
    batches = []
    for b in ld.epoch(0):  # features live in reused buffers: check each batch while it is current
        assert np.array_equal(b.x.numpy(), x[b.node_ids.numpy()])
        assert np.array_equal(b.y.numpy(), y[b.targets.numpy()])
        batches.append(b)
    assert len(batches) == len(ld) == 5
    seen = np.concatenate([b.targets.numpy() for b in batches])
    assert np.array_equal(np.sort(seen), ids)
    again = list(NeighborLoader(s, ids, 32, x=x, y=y, seed=5, prefetch=0).epoch(0))
    assert all(torch.equal(a.node_ids, b.node_ids) for a, b in zip(batches, again))
    other = list(ld.epoch(1))
    assert not torch.equal(batches[0].targets, other[0].targets)


def test_loader_delivers_batches_on_its_device(csr):
    """Batches reach the loader's device whole (blocks, features, labels); ``meta`` stands in for a GPU."""
    indptr, indices = csr
    x = np.ones((300, 2), dtype=np.float32)
    y = np.arange(300) % 3
    ld = NeighborLoader(NeighborSampler(indptr, indices, [3, 2]), np.arange(64), 32, x=x, y=y, prefetch=0,
                        device="meta")
    for b in ld.epoch(0):
        assert b.x.device.type == b.y.device.type == "meta"
        assert all(blk.indptr.device.type == blk.indices.device.type == "meta" for blk in b.blocks)
