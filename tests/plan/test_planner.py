"""The planner's rewrites: pushdown, cost-based order, and the general plan for parameterized messages."""

from trellis.plan import GraphStats, plan_layer
from trellis.plan.cost import spmm_cost
from trellis.plan.decl import LayerDecl

S = GraphStats(num_src=100_000, num_dst=100_000, num_edges=2_000_000)


def test_unparameterized_message_is_pushed_down_to_one_spmm():
    plan = plan_layer(LayerDecl("gcn", 128, 256, message="weighted", root="self_loop"), S)
    assert plan.pushdown
    assert [op.kind for op in plan.ops].count("spmm") == 1
    assert "gather" not in [op.kind for op in plan.ops]


def test_aggregate_runs_at_the_narrower_width():
    widening = plan_layer(LayerDecl("gcn", 128, 256, message="weighted"), S)
    narrowing = plan_layer(LayerDecl("gcn", 256, 16, message="weighted"), S)
    assert widening.aggregate_first and widening.ops[0].kind == "spmm"
    assert not narrowing.aggregate_first and narrowing.ops[-1].kind == "spmm"
    spmm = [op for op in narrowing.ops if op.kind == "spmm"][0]
    assert spmm.cost == spmm_cost(S, 16, True)


def test_max_keeps_transform_first():
    plan = plan_layer(LayerDecl("sage-max", 128, 16, aggregate="max", root="linear"), S)
    assert not plan.aggregate_first


def test_parameterized_message_materializes_edges():
    plan = plan_layer(LayerDecl("edge-mlp", 64, 64, message="custom", message_params=True), S)
    kinds = [op.kind for op in plan.ops]
    assert not plan.pushdown and kinds[:3] == ["gather", "apply_edge", "segment_reduce"]
    gather = plan.ops[0]
    assert gather.cost.out_bytes == S.num_edges * 64 * 4


def test_attention_has_no_per_edge_feature_tensor():
    plan = plan_layer(LayerDecl("gat", 128, 256, heads=4, message="attention", message_params=True), S)
    per_edge = [op for op in plan.ops if op.kind in ("sddmm", "edge_softmax")]
    assert per_edge and all(op.cost.out_bytes == S.num_edges * 4 * 4 for op in per_edge)
    assert plan.peak_intermediate_bytes < S.num_edges * 256 * 4
    text = plan.format()
    assert "edge_softmax" in text and "FLOP" in text
