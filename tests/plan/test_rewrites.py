"""Planner v2: whole-model plans, the shared constant aggregation, elementwise fusion and the choice of K."""

import pytest

from trellis.errors import TrellisUserError
from trellis.plan import GraphStats
from trellis.plan.batching import balanced_batches, choose_k
from trellis.plan.decl import LayerDecl
from trellis.plan.ir import ModelDecl
from trellis.plan.planner import choose_order, plan_layer, plan_model
from trellis.plan.rewrites import FUSE, SHARE, fuse_elementwise

S = GraphStats(num_src=100_000, num_dst=100_000, num_edges=2_000_000)


def gcn(hidden=64, dropout_p=0.5, f=128, c=16, layers=2, family="gcn"):
    dims = [f] + [hidden] * (layers - 1) + [c]
    decls = tuple(LayerDecl("gcn", a, b, message="weighted", root="self_loop") for a, b in zip(dims, dims[1:]))
    return ModelDecl(family, decls, dropout_p)


def sage_max(hidden=64):
    return ModelDecl("sage", (LayerDecl("sage", 128, hidden, aggregate="max", root="linear"),
                              LayerDecl("sage", hidden, 16, aggregate="max", root="linear")), 0.0)


def kinds(plan):
    return [op.kind for op in plan.ops]


def test_first_layer_aggregation_is_cached_only_when_its_input_is_constant():
    ev = plan_model([gcn()], S, training=False)
    cached = [op for op in ev.ops if op.cached]
    assert SHARE in ev.rewrites and len(cached) == 1 and cached[0].kind == "spmm"
    assert ev.layers[0].is_cached(0) and ev.layers[0].aggregate_first
    # dropout on the input changes it every step: nothing to cache
    assert not any(op.cached for op in plan_model([gcn(dropout_p=0.5)], S, training=True).ops)
    # no dropout: the training step reads the cache too
    assert any(op.cached for op in plan_model([gcn(dropout_p=0.0)], S, training=True).ops)
    # learned features need gradients: not constant
    assert not any(op.cached for op in plan_model([gcn(dropout_p=0.0)], S, input_grad=True).ops)
    # max does not commute / is not shared
    assert not any(op.cached for op in plan_model([sage_max()], S, training=False).ops)
    # rewrites off
    assert not any(op.cached for op in plan_model([gcn()], S, training=False, rewrites=()).ops)


def test_cached_work_is_paid_once_not_per_step():
    on = plan_model([gcn(256)], S, training=False)
    off = plan_model([gcn(256)], S, training=False, rewrites=())  # aggregate-first too (widening)
    spmm0 = next(op for op in on.ops if op.cached)
    assert on.once_cost.flops == spmm0.cost.flops
    assert on.forward_cost.flops == pytest.approx(off.forward_cost.flops - spmm0.cost.flops)
    assert on.seconds() < off.seconds()
    assert "cached: once" in on.format() and "once (cached across epochs)" in on.format()


def test_batched_configs_share_one_cached_aggregation_and_one_spmm_per_layer():
    models = [gcn(h, p) for h in (64, 128, 256) for p in (0.0, 0.5)]
    train = plan_model(models, S, training=True)
    for lp in train.layers:
        live = [op for op in lp.ops if op.kind == "spmm" and not op.cached]
        assert len(live) == 1  # the graph is read once per layer for all configurations
    assert sum(op.cached for op in train.ops) == 1  # the three p = 0 configurations share one Â X
    assert [train.layers[0].is_cached(k) for k in range(6)] == [True, False] * 3
    wide = next(op for op in train.layers[1].ops if op.kind == "spmm")
    assert wide.cost.accesses == S.num_edges  # one random row access per edge for all six
    assert "width 96" in wide.detail  # 6 x 16 classes, transform first


def test_fusion_merges_the_epilogue_and_saves_memory():
    fused = plan_model([gcn(256, 0.5)], S, training=True)
    plain = plan_model([gcn(256, 0.5)], S, training=True, rewrites=(SHARE,))
    assert FUSE in fused.rewrites and FUSE not in plain.rewrites
    f0 = [op for op in fused.layers[0].ops if op.kind == "fused"]
    assert len(f0) == 1 and "bias+activation+dropout" in f0[0].detail
    assert fused.activation_bytes < plain.activation_bytes
    assert fused.forward_cost.bytes == pytest.approx(plain.forward_cost.bytes)  # eager: the passes remain
    assert fused.forward_cost.flops == pytest.approx(plain.forward_cost.flops)


def test_fusion_of_dropout_and_concat_for_a_batch():
    plan = plan_model([gcn(64, 0.3), gcn(128, 0.5)], S, training=True)
    first = plan.layers[0].ops[0]
    assert first.kind == "fused" and first.detail.startswith("dropout+concat x2")
    assert "concat" not in kinds(plan.layers[0])
    lp = plan_model([gcn(64, 0.3), gcn(128, 0.5)], S, training=True, rewrites=()).layers[0]
    assert fuse_elementwise(lp).ops[0].kind == "fused"


def test_training_aware_order_avoids_the_backward_spmm_of_the_features():
    d = LayerDecl("gcn", 128, 64, message="weighted", root="self_loop")
    assert not plan_layer(d, S).aggregate_first  # v1: forward only, narrower SpMM after the transform
    agg_first, why = choose_order(d, S, input_grad=False, training=True)
    assert agg_first and "aggregate-first" in why  # v2: no backward SpMM when features need no gradient
    assert not choose_order(LayerDecl("gcn", 256, 16, message="weighted", root="self_loop"), S)[0]
    step = plan_model([gcn(64, 0.5)], S)
    spmm0 = next(op for op in step.layers[0].ops if op.kind == "spmm")
    assert not spmm0.input_grad and spmm0.backward.bytes == 0


def test_batching_refuses_mixed_families_depths_and_attention():
    with pytest.raises(TrellisUserError, match="different model families"):
        plan_model([gcn(), gcn(family="sage")], S)
    with pytest.raises(TrellisUserError, match="different depths"):
        plan_model([gcn(), gcn(layers=3)], S)
    gat = ModelDecl("gat", (LayerDecl("gat", 128, 64, heads=4, message="attention", message_params=True),), 0.6)
    assert plan_model([gat], S).layers[0].ops  # one configuration plans fine
    with pytest.raises(TrellisUserError, match="cannot be model-batched"):
        plan_model([gat, gat], S)
    with pytest.raises(TrellisUserError, match="at least one"):
        plan_model([], S)
    mean = ModelDecl("sage", (LayerDecl("sage", 128, 64, aggregate="mean", root="linear"),
                              LayerDecl("sage", 64, 16, aggregate="mean", root="linear")), 0.0)
    with pytest.raises(TrellisUserError, match="differs in kind"):
        plan_model([mean, sage_max()], S)


def test_balanced_batches():
    assert [len(b) for b in balanced_batches(12, 8)] == [6, 6]
    assert [len(b) for b in balanced_batches(12, 5)] == [4, 4, 4]
    assert [len(b) for b in balanced_batches(7, 3)] == [3, 2, 2]
    assert [list(b) for b in balanced_batches(3, 10)] == [[0, 1, 2]]
    assert balanced_batches(0, 4) == []


def test_choose_k_follows_the_cost_model_and_the_memory_budget():
    models = [gcn(h, p) for h in (64, 128, 256) for p in (0.3, 0.5)] * 2
    big = choose_k(models, S, budget_bytes=1e12, min_gain=0.0)
    secs = [e.epoch_seconds for e in big.estimates]
    assert all(a >= b * 0.999 for a, b in zip(secs, secs[1:]))  # larger K is never estimated slower here
    assert big.k > 1 and "gain" in big.reason
    gain = secs[0] / secs[-1] - 1
    assert 0 < gain < 0.5  # on this CPU the shared aggregation is a small part of an epoch
    cautious = choose_k(models, S, budget_bytes=1e12, min_gain=gain + 0.01)
    assert cautious.k == 1 and "predicts at most" in cautious.reason
    small = choose_k(models, S, budget_bytes=big.estimates[1].peak_bytes * 1.01, min_gain=0.0)
    assert small.k <= big.estimates[1].k and all(e.fits == (e.peak_bytes <= small.budget_bytes)
                                                  for e in small.estimates)
    assert choose_k(models, S, budget_bytes=1.0).k == 1
    forced = choose_k(models, S, budget_bytes=1e12, override=6)
    assert forced.k == 6 and "--batch-models 6" in forced.reason and "<- chosen" in forced.format()
    assert choose_k(models, S, budget_bytes=1e12, override=5).k == 4  # balanced: 4 + 4 + 4
    assert choose_k(models, S, budget_bytes=1e12, override=99).k == 12
    with pytest.raises(TrellisUserError, match="positive"):
        choose_k(models, S, budget_bytes=1e12, override=0)


def test_a_sparse_input_is_planned_as_it_runs():
    """Bag-of-words rows run sparse: transformed first, dropout and product over the stored values only. The plan
    assumed a dense [N, F] input (on Coauthor CS a 3.5 GB dropout and a cached aggregate-first evaluation that
    never ran, and the sweep's K priced on it)."""
    from dataclasses import replace

    wide = gcn(f=6805, hidden=16)
    dense_ev = plan_model([wide], S, training=False)
    sparse = replace(S, sparse_input=0.01)
    ev, step = plan_model([wide], sparse, training=False), plan_model([wide], sparse, training=True)
    assert dense_ev.layers[0].aggregate_first and any(op.cached for op in dense_ev.ops)
    for plan in (ev, step):
        assert not plan.layers[0].aggregate_first and not any(op.cached for op in plan.ops)
        assert "sparse input, 1.00% stored" in plan.format()
    dense_step = plan_model([wide], replace(S, sparse_input=None), training=True)
    drop = [op for op in step.ops if "dropout input" in op.detail]
    dense_drop = [op for op in dense_step.ops if "dropout input" in op.detail]
    assert drop[0].cost.bytes == pytest.approx(0.01 * dense_drop[0].cost.bytes)
    assert step.seconds() < dense_step.seconds() / 5


def test_a_bag_of_words_store_is_planned_sparse(dataset, tmp_path):
    """FullBatch hands the planner the share of the features' stored values (Cora's are about 1.3%)."""
    import torch

    from trellis.data.importers import import_graph
    from trellis.train.config import TrainConfig
    from trellis.train.strategies.full import FullBatch

    store = import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)
    st = FullBatch(TrainConfig(store=str(store), model="gcn"), torch.device("cpu"))
    st.load()
    assert 0.005 < st.plan_stats().sparse_input < 0.03
