"""Plan rewrites that look beyond one layer.

Two rewrites of planner v2 (the issue's part 1; pushdown and transform/aggregate reordering live in
:mod:`trellis.plan.planner`):

* **Sharing a constant aggregation** (:func:`share_constant_aggregation`). The first layer's input is the
  feature matrix, which never changes across epochs; without input dropout (or in every evaluation pass)
  ``Â X`` is the same tensor every step. Aggregating first and caching ``Â X`` turns the layer's graph work
  into a one-time cost, and in a model-batched sweep every configuration shares the one cached tensor.
* **Fusing consecutive elementwise ops** (:func:`fuse_elementwise`). A hidden layer ends in bias add,
  activation and the next layer's dropout, which eager PyTorch runs as separate autograd nodes that each
  keep a tensor (the activation's output, the dropout mask) alive for backward; fused, they are one node
  that keeps only its output, and the plan counts one kept tensor. The passes themselves remain (no code
  generation here), so FLOPs and bytes are unchanged — except where a whole pass disappears: each
  configuration's dropped-out features are written straight into the wide SpMM input instead of being
  concatenated afterwards.

These passes only edit plans. The layer that runs a plan carries them out (:mod:`trellis.nn.runtime`: the
aggregation cache, the fused epilogue, per-configuration random streams), so ``plan`` never imports ``nn``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trellis.plan import cost as C
from trellis.plan.ir import ConfigLayer, LayerPlan, Op

SHARE = "share_constant_aggregation"
FUSE = "fuse_elementwise"
#: Rewrites applied by default, in order.
DEFAULT_REWRITES = (SHARE, FUSE)


# ---- plan passes ------------------------------------------------------------------------------------
def share_constant_aggregation(layers: Sequence[Sequence[ConfigLayer]]) -> int:
    """Let every configuration whose layer input is constant read one cached aggregation of it.

    Applies where the aggregation is linear in the input and has no parameters (sum or mean of the source
    rows, optionally with fixed edge weights), so ``aggregate(X)`` is a pure function of the graph and the
    features. The configuration is switched to aggregate-first: its per-step work is only its transform.

    Args:
        layers: Per layer, per configuration decisions (edited in place).

    Returns:
        Number of (layer, configuration) pairs that now read the cache.
    """
    shared = 0
    for layer in layers:
        for c in layer:
            d = c.decl
            if c.input_constant and not c.input_grad and d.unparameterized_message and d.aggregate in ("sum", "mean"):
                c.cached, c.aggregate_first = True, True
                shared += 1
    return shared


def fuse_elementwise(plan: LayerPlan) -> LayerPlan:
    """Merge each run of consecutive elementwise ops of a layer into one ``fused`` op.

    The fused op reads its input once and writes one output (kept for backward), instead of one read,
    one write and one kept tensor per op. The runtime counterpart is
    :func:`trellis.nn.runtime.bias_act_dropout`.
    """
    ops: list[Op] = []
    run: list[Op] = []

    def flush() -> None:
        if len(run) == 1:
            ops.append(run[0])
        elif run:
            # Eager PyTorch still makes each op's pass (in place), so FLOPs and bytes stay; what fusion
            # saves is memory: one output kept for backward instead of every op's output and mask.
            out = max(o.cost.out_bytes / (2 if o.detail.startswith("dropout") else 1) for o in run)
            flops = sum(o.cost.flops for o in run)
            moved = sum(o.cost.bytes for o in run)
            names = "+".join(o.detail.split(" ", 1)[0] for o in run)
            width = run[-1].detail.split(" ", 1)[1] if " " in run[-1].detail else ""
            draws = sum(o.cost.draws for o in run)
            ops.append(Op("fused", f"{names} {width}".strip(), C.Cost(flops, moved, out, 0.0, draws),
                          input_grad=any(o.input_grad for o in run), launches=max(o.launches for o in run)))
        run.clear()

    src = list(plan.ops)
    if (len(src) > 1 and src[0].kind == "elementwise" and src[0].detail.startswith("dropout input")
            and src[1].kind == "concat" and not src[1].input_grad and src[0].launches == _inputs(src[1])):
        # Every configuration's dropped-out copy of a gradient-free input is written straight into its
        # columns of the wide SpMM input: the concatenation pass disappears.
        d, c = src[0], src[1]
        src[:2] = [Op("fused", f"dropout+concat x{d.launches} -> {c.detail.rsplit(' ', 1)[-1]} wide",
                      C.Cost(d.cost.flops, d.cost.bytes, c.cost.out_bytes, 0.0, d.cost.draws), input_grad=False,
                      launches=d.launches)]
    for op in src:
        if op.kind == "elementwise" and op.fusable and not op.cached:
            run.append(op)
        else:
            flush()
            ops.append(op)
    flush()
    if len(ops) == len(plan.ops):
        return plan
    return replace(plan, ops=tuple(ops), notes=(*plan.notes, "consecutive elementwise ops fused into one pass"))


def _inputs(concat: Op) -> int:
    """Number of inputs a ``concat`` op joins (from its detail, ``"K inputs -> width W"``)."""
    head = concat.detail.split(" ", 1)[0]
    return int(head) if head.isdigit() else -1
