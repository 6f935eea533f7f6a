"""Plan rewrites that look beyond one layer, and the runtime pieces that carry them out.

Two rewrites of planner v2 (the issue's part 1; pushdown and transform/aggregate reordering live in
:mod:`trellis.plan.planner`):

* **Sharing a constant aggregation** (:func:`share_constant_aggregation`). The first layer's input is the
  feature matrix, which never changes across epochs; without input dropout (or in every evaluation pass)
  ``Â X`` is the same tensor every step. Aggregating first and caching ``Â X`` turns the layer's graph work
  into a one-time cost, and in a model-batched sweep every configuration shares the one cached tensor.
  :class:`AggregationCache` holds it, keyed on the exact graph and feature tensor (and the tensor's version
  counter, so an in-place edit of the features invalidates it).
* **Fusing consecutive elementwise ops** (:func:`fuse_elementwise`). A hidden layer ends in bias add,
  activation and the next layer's dropout, which eager PyTorch runs as separate autograd nodes that each
  keep a tensor (the activation's output, the dropout mask) alive for backward. :func:`bias_act_dropout`
  runs them as one autograd node, in place, keeping only its output (the gradient of all three is
  recoverable from it: ``dy/dx = scale`` where ``y > 0``, else 0); the plan counts one kept tensor. The
  passes themselves remain (no code generation here), so FLOPs and bytes are unchanged — except where a
  whole pass disappears: each configuration's dropped-out features are written straight into the wide
  SpMM input instead of being concatenated afterwards.

Why dropout masks are drawn from explicit generators: a model-batched sweep must reproduce each
configuration's solo run. :func:`generator_scope` makes the default generator of a device temporarily
*be* a configuration's own generator, so the exact op the solo model runs (``F.dropout``) draws the exact
mask it would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.ops import dropout as hash_dropout
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
    one write and one kept tensor per op. The runtime counterpart is :func:`bias_act_dropout`.
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


# ---- runtime: the cached aggregation ----------------------------------------------------------------
@dataclass
class _Entry:
    graph: Any
    x: Tensor
    version: int
    key: str
    value: Tensor


class AggregationCache:
    """Aggregations of constant inputs, computed once and reused across epochs and configurations.

    Entries are matched by identity of the graph and the input tensor plus the tensor's version counter
    (bumped by any in-place write), never by shape or address alone, so a stale value cannot be returned.

    Args:
        capacity: Entries kept (least recently used dropped first) (default: 4).
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._entries: list[_Entry] = []
        self.hits = 0
        self.misses = 0

    def get(self, graph: Any, x: Tensor, key: str, compute: Callable[[], Tensor]) -> Tensor:
        """The cached ``compute()`` for ``(graph, x, key)``, computing it (without autograd) on a miss."""
        version = x._version
        for i, e in enumerate(self._entries):
            if e.graph is graph and e.x is x and e.version == version and e.key == key:
                self.hits += 1
                self._entries.append(self._entries.pop(i))
                return e.value
        self.misses += 1
        with torch.no_grad():
            value = compute()
        self._entries.append(_Entry(graph, x, version, key, value))
        if len(self._entries) > self.capacity:
            self._entries.pop(0)
        return value

    def clear(self) -> None:
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.value.numel() * e.value.element_size() for e in self._entries)


# ---- runtime: per-configuration random streams -------------------------------------------------------
def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ValueError(f"no default generator for device {device}")


@contextmanager
def generator_scope(generator: torch.Generator | None) -> Iterator[None]:
    """Within the block, the default generator of ``generator``'s device draws from ``generator``.

    On exit the advanced state is written back to ``generator`` and the default generator is restored, so
    ops that take no generator argument (``F.dropout``, CUDA's fused dropout) draw exactly what they would
    draw in a solo run whose default generator was in that state. ``None`` leaves the default in place.
    """
    if generator is None:
        yield
        return
    default = _default_generator(generator.device)
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(default.get_state())
        default.set_state(saved)


def dropout(x: Tensor, p: float, training: bool, generator: torch.Generator | None = None) -> Tensor:
    """The models' dropout drawing from ``generator`` (bit-identical to a solo run in the same state).

    On CPU that is the counter-based dropout (:mod:`trellis.ops.dropout`) with its seed drawn from
    ``generator``; elsewhere ``F.dropout`` under :func:`generator_scope`.
    """
    if not training or p == 0.0:
        return x
    if hash_dropout.applies(x):
        return hash_dropout.dropout(x, p, True, generator)
    with generator_scope(generator):
        return F.dropout(x, p, True)


# ---- runtime: the fused epilogue ---------------------------------------------------------------------
class _BiasActDropout(torch.autograd.Function):
    """``dropout(relu(x + bias))`` as one autograd node that saves only its output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor | None, p: float,  # type: ignore[override]
                generator: torch.Generator | None) -> Tensor:
        y = x + bias if bias is not None else x.clone()
        y.relu_()
        scale = None
        if p > 0.0:
            # The counter-based mask the unfused chain's dropout draws (same seed draw, same shape), applied
            # in place: values equal the unfused chain's bit for bit.
            hash_dropout.apply_(y, p, generator)
            scale = torch.ones((), dtype=y.dtype, device=y.device).div_(1.0 - p)
        ctx.save_for_backward(y)
        ctx.scale, ctx.has_bias = scale, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        g = grad * ctx.scale if ctx.scale is not None else grad
        # y > 0 exactly where relu passed the value and the mask kept it; elsewhere the chain's gradient is
        # 0 (relu) or 0 * grad (dropped).
        g = g.masked_fill(y <= 0, 0.0)
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return g, gb, None, None


def bias_act_dropout(x: Tensor, bias: Tensor | None, *, act: bool, p: float, training: bool,
                     generator: torch.Generator | None = None) -> Tensor:
    """``dropout(relu(x + bias), p)`` fused into one pass that keeps one tensor for backward.

    Equal in values and gradients to the unfused chain ``F.dropout(F.relu(x + bias), p)`` drawing from the
    same generator. The fused path runs on CPU; other devices (whose fused dropout kernel draws differently
    from ``bernoulli_``) run the unfused chain under :func:`generator_scope`, which is still exact.

    Args:
        x: Layer output before bias ``[N, d]``.
        bias: Bias ``[d]`` or None.
        act: Apply ReLU.
        p: Dropout rate of the next layer's input.
        training: Dropout only in training.
        generator: The configuration's generator (None: the default one).
    """
    p = p if training else 0.0
    if not act or p >= 1.0 or (p > 0.0 and not hash_dropout.applies(x)):
        y = x + bias if bias is not None else x
        return dropout(F.relu(y) if act else y, p, True, generator)
    return _BiasActDropout.apply(x, bias, p, generator)
