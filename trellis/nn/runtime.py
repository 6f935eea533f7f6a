"""The runtime pieces that carry out the planner's rewrites, owned by the layer that runs a plan.

* :class:`AggregationCache` holds the aggregation of a constant input (the features, undropped) that the
  ``share_constant_aggregation`` rewrite (:mod:`trellis.plan.rewrites`) marks as computed once, keyed on the
  exact graph and feature tensor (and the tensor's version counter, so an in-place edit of the features
  invalidates it).
* :func:`bias_act_dropout` is the ``fuse_elementwise`` rewrite's fused epilogue: bias add, ReLU and the next
  layer's dropout as one autograd node, in place, keeping only its output (the gradient of all three is
  recoverable from it: ``dy/dx = scale`` where ``y > 0``, else 0).

Why dropout masks are drawn from explicit generators: a model-batched sweep must reproduce each
configuration's solo run. :func:`generator_scope` makes the default generator of a device temporarily
*be* a configuration's own generator, so the exact op the solo model runs (``F.dropout``) draws the exact
mask it would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.ops import dropout as hash_dropout


# ---- the cached aggregation -------------------------------------------------------------------------
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
        """Drop every entry (their tensors are freed once nothing else holds them)."""
        self._entries.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached values (what a memory budget must count)."""
        return sum(e.value.numel() * e.value.element_size() for e in self._entries)


# ---- per-configuration random streams -----------------------------------------------------------------
def default_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device`` (the one ops without a generator argument draw from)."""
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
    default = default_generator(generator.device)
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
    if hash_dropout.applies(x) or x.layout == torch.sparse_csr:  # sparse input rows: dropout of their values
        return hash_dropout.dropout(x, p, True, generator)
    with generator_scope(generator):
        return F.dropout(x, p, True)


# ---- the fused epilogue ---------------------------------------------------------------------------------
class _BiasActDropout(torch.autograd.Function):
    """``dropout(relu(x + bias))`` as one autograd node that saves only its output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bias: Tensor | None, p: float,
                generator: torch.Generator | None, seed: int | None) -> Tensor:
        y = x + bias if bias is not None else x.clone()
        y.relu_()
        scale = None
        if p > 0.0:
            # The counter-based mask the unfused chain's dropout draws (same seed draw, same shape), applied
            # in place: values equal the unfused chain's bit for bit.
            hash_dropout.apply_(y, p, generator, seed)
            scale = torch.ones((), dtype=y.dtype, device=y.device).div_(1.0 - p)
        ctx.save_for_backward(y)
        ctx.scale, ctx.has_bias = scale, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        g = grad * ctx.scale if ctx.scale is not None else grad
        # y > 0 exactly where relu passed the value and the mask kept it; elsewhere the chain's gradient is
        # 0 (relu) or 0 * grad (dropped).
        g = g.masked_fill(y <= 0, 0.0)
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return g, gb, None, None, None


def bias_act_dropout(x: Tensor, bias: Tensor | None, *, act: bool, p: float, training: bool,
                     generator: torch.Generator | None = None, seed: int | None = None) -> Tensor:
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
        seed: The mask's seed instead of a draw from ``generator`` (CPU only): a row tile of a larger
            output passes :func:`trellis.ops.dropout.tile_seed` of the whole output's seed.
    """
    p = p if training else 0.0
    if not act or p >= 1.0 or (p > 0.0 and not hash_dropout.applies(x)):
        if seed is not None:
            raise ValueError("an explicit dropout seed needs the fused CPU path (ReLU, p < 1, a CPU float tensor)")
        y = x + bias if bias is not None else x
        return dropout(F.relu(y) if act else y, p, True, generator)
    return _BiasActDropout.apply(x, bias, p, generator, seed)
