"""Model batching: K configurations of one model family and depth run as one model (Lotan §5.2).

Why: a hyperparameter sweep trains many models on the same graph, and each of them reads the whole graph
in every layer of every step. Here the K configurations' inputs of a layer are concatenated along the
feature axis, so each layer runs **one** SpMM that reads every edge once for all K (the graph engine's
random row accesses, its index and weight reads, and its launches are shared), while every
configuration keeps its own transforms, hidden size, dropout rate and random stream. Each configuration
also keeps its order of transform and aggregation (the planner picks it from that configuration's widths),
and configurations whose first-layer input is the constant feature matrix share one cached ``Â X``
(:mod:`trellis.plan.rewrites`).

Equivalence with solo runs is by construction, not by approximation:

* :class:`BatchedGNN` wraps the K solo models themselves (built exactly as ``trellis train`` builds them,
  so their initial weights are the solo run's) and uses their parameters, so each configuration has its
  own optimizer over its own parameters;
* each configuration's dropout masks come from its own generator, started in the state the solo run's
  default generator has when its training starts (:func:`capture_generator`), and drawn by the same ops;
* columns of an SpMM do not interact, so configuration k's columns of the wide aggregation equal its
  narrow aggregation, and a stopped configuration can be dropped (:meth:`BatchedGNN.drop`) without
  changing the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.nn.layers import GCNConv, GINConv, MessagePassing, SAGEConv
from trellis.nn.models import GNN
from trellis.ops import dropout as hash_dropout
from trellis.ops import gcn_norm, spmm
from trellis.ops.graph import CSRGraph
from trellis.plan import GraphStats
from trellis.plan.ir import LayerPlan, ModelDecl, ModelPlan
from trellis.plan.planner import check_batchable, plan_model
from trellis.plan.rewrites import (
    DEFAULT_REWRITES,
    FUSE,
    AggregationCache,
    bias_act_dropout,
    dropout,
)

#: Layer classes that can be model-batched, by family name.
BATCHABLE: dict[type[MessagePassing], str] = {GCNConv: "gcn", SAGEConv: "sage", GINConv: "gin"}


def capture_generator(device: torch.device | str) -> torch.Generator:
    """A generator in the current state of ``device``'s default generator.

    Called right after a configuration's solo model has been built (after ``seed_everything(seed)`` and
    ``make_model``, as the trainer does), it starts where the solo run's dropout would start drawing.
    """
    device = torch.device(device)
    g = torch.Generator(device=device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        g.set_state(torch.cuda.default_generators[index].get_state())
    else:
        g.set_state(torch.default_generator.get_state())
    return g


def family_of(model: nn.Module) -> str:
    """The model family of a GNN whose layers can be batched (``gcn``, ``sage``, ``gin``).

    Raises:
        TrellisUserError: The model is not a batchable GNN (e.g. GAT, MLP) or mixes layer types.
    """
    convs = getattr(model, "convs", None)
    if not isinstance(model, GNN) or convs is None or type(model) is not GNN:
        raise TrellisUserError(f"{type(model).__name__} cannot be model-batched; batchable families: "
                               f"{', '.join(sorted(set(BATCHABLE.values())))}")
    names = {BATCHABLE.get(type(c)) for c in convs}
    if None in names or len(names) != 1:
        kinds = ", ".join(sorted({type(c).__name__ for c in convs}))
        raise TrellisUserError(f"a model with layers {kinds} cannot be model-batched; batchable families: "
                               f"{', '.join(sorted(set(BATCHABLE.values())))}")
    if model.activation is not F.relu:
        raise TrellisUserError("model batching supports ReLU between layers only")
    return names.pop()  # type: ignore[return-value]


def model_decl(model: GNN, family: str | None = None) -> ModelDecl:
    """The planner's view of one configuration (its layers' declarations and its dropout)."""
    return ModelDecl(family or family_of(model), tuple(c.declare() for c in model.convs), float(model.dropout))


# ---- per-family layer adapters --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Family:
    """How one layer type splits into (transform before aggregation) / aggregation / (after)."""

    def agg_args(self, conv: nn.Module, graph: CSRGraph) -> tuple[Tensor | None, Tensor | None, str]:
        raise NotImplementedError

    def pre_weight(self, conv: nn.Module) -> Tensor:
        """The weight a transform-first configuration applies before aggregating."""
        raise NotImplementedError

    def post(self, conv: nn.Module, a: Tensor, h: Tensor, z: Tensor | None, agg_first: bool, n: int) -> Tensor:
        """Layer output (before the epilogue) from the aggregation ``a``, input ``h``, pre-transform ``z``."""
        raise NotImplementedError

    def bias(self, conv: nn.Module) -> Tensor | None:
        """A bias added in the epilogue (None when the layer adds it inside a linear map)."""
        return None


class _GCN(_Family):
    def agg_args(self, conv: nn.Module, graph: CSRGraph) -> tuple[Tensor | None, Tensor | None, str]:
        ew, sw = gcn_norm(graph, add_self_loops=True)
        return ew, sw, "sum"

    def pre_weight(self, conv: nn.Module) -> Tensor:
        return conv.lin.weight

    def post(self, conv: nn.Module, a: Tensor, h: Tensor, z: Tensor | None, agg_first: bool, n: int) -> Tensor:
        return conv.lin(a) if agg_first else a

    def bias(self, conv: nn.Module) -> Tensor | None:
        return conv.bias


class _SAGE(_Family):
    def agg_args(self, conv: nn.Module, graph: CSRGraph) -> tuple[Tensor | None, Tensor | None, str]:
        return None, None, conv.aggregate

    def pre_weight(self, conv: nn.Module) -> Tensor:
        return conv.lin_l.weight

    def post(self, conv: nn.Module, a: Tensor, h: Tensor, z: Tensor | None, agg_first: bool, n: int) -> Tensor:
        neigh = conv.lin_l(a) if agg_first else a + conv.lin_l.bias
        return neigh + conv.lin_r(h[:n])


class _GIN(_Family):
    def agg_args(self, conv: nn.Module, graph: CSRGraph) -> tuple[Tensor | None, Tensor | None, str]:
        return None, None, "sum"

    def pre_weight(self, conv: nn.Module) -> Tensor:
        return conv.lin1.weight

    def post(self, conv: nn.Module, a: Tensor, h: Tensor, z: Tensor | None, agg_first: bool, n: int) -> Tensor:
        if agg_first:
            hid = conv.lin1(a + (1 + conv.eps) * h[:n])
        else:
            assert z is not None
            hid = a + (1 + conv.eps) * z[:n] + conv.lin1.bias
        return conv.lin2(F.relu(hid))


_FAMILIES: dict[str, _Family] = {"gcn": _GCN(), "sage": _SAGE(), "gin": _GIN()}


class BatchedGNN(nn.Module):
    """K GNN configurations of one family and depth, trained as one model.

    Args:
        models: The configurations' solo models (their parameters are used, not copied: build each
            configuration's optimizer over ``models[k].parameters()``).
        generators: Per configuration, the generator its dropout masks are drawn from (see
            :func:`capture_generator`); None draws from the default generator.
        rewrites: Planner rewrites to apply (default: all; pass ``()`` to measure without them).

    Raises:
        TrellisUserError: Models of different families or depths, or a family that cannot be batched.

    Calling ``model(graph, x)`` returns a list of logits, one ``[N, C]`` tensor per *active* configuration
    (see :attr:`active`), in order.
    """

    def __init__(self, models: Sequence[nn.Module], generators: Sequence[torch.Generator | None] | None = None,
                 rewrites: Sequence[str] = DEFAULT_REWRITES) -> None:
        super().__init__()
        if not models:
            raise TrellisUserError("a model batch needs at least one configuration")
        families = [family_of(m) for m in models]
        self.decls = [model_decl(m, f) for m, f in zip(models, families)]  # type: ignore[arg-type]
        check_batchable(self.decls)
        self.family = families[0]
        self.models = nn.ModuleList(models)
        self.generators = list(generators) if generators is not None else [None] * len(models)
        if len(self.generators) != len(models):
            raise ValueError("one generator per configuration")
        self.rewrites = tuple(rewrites)
        self.active: list[int] = list(range(len(models)))
        self.cache = AggregationCache()
        self._plans: dict[tuple, ModelPlan] = {}

    @property
    def depth(self) -> int:
        return self.decls[0].depth

    def drop(self, k: int) -> None:
        """Remove configuration ``k`` (an index into the original list) from the batch: it stopped."""
        if k in self.active:
            self.active.remove(k)

    def plan(self, graph: CSRGraph, training: bool | None = None, input_grad: bool = False) -> ModelPlan:
        """The plan of the active configurations on ``graph`` (cached per graph shape, mode and batch)."""
        training = self.training if training is None else training
        stats = GraphStats.of(graph)
        key = (stats, tuple(self.active), training, input_grad)
        if key not in self._plans:
            self._plans[key] = plan_model([self.decls[k] for k in self.active], stats, training=training,
                                          rewrites=self.rewrites, input_grad=input_grad)
        return self._plans[key]

    def explain(self, graph: CSRGraph) -> str:
        """Training-step and evaluation-pass plans of the active configurations."""
        return f"{self.plan(graph, True).format()}\n\n{self.plan(graph, False).format()}"

    def forward(self, graph: CSRGraph, x: Tensor) -> list[Tensor]:
        """Logits of every active configuration (a list in :attr:`active` order)."""
        if not isinstance(graph, CSRGraph):
            raise TypeError("model batching runs on one graph (full-batch); got per-layer blocks")
        if not self.active:
            return []
        plan = self.plan(graph, self.training, x.requires_grad)
        fam = _FAMILIES[self.family]
        act = self.active
        models = [self.models[k] for k in act]
        gens = [self.generators[k] for k in act]
        fuse = FUSE in plan.rewrites
        hs, wide0 = self._first_inputs(x, models, gens, plan.layers[0], fuse)
        for i, lp in enumerate(plan.layers):
            convs = [m.convs[i] for m in models]
            outs = self._layer(graph, x, fam, convs, hs, lp, first=i == 0, prebuilt=wide0 if i == 0 else None)
            if i == self.depth - 1:
                return [o + b if (b := fam.bias(c)) is not None else o for o, c in zip(outs, convs)]
            hs = []
            for o, c, m, g in zip(outs, convs, models, gens):
                if fuse:
                    hs.append(bias_act_dropout(o, fam.bias(c), act=True, p=m.dropout, training=self.training,
                                               generator=g))
                else:
                    b = fam.bias(c)
                    hs.append(dropout(F.relu(o + b if b is not None else o), m.dropout, self.training, g))
        raise AssertionError("unreachable")

    def _first_inputs(self, x: Tensor, models: list[nn.Module], gens: list[torch.Generator | None],
                      lp: LayerPlan, fuse: bool) -> tuple[list[Tensor], Tensor | None]:
        """Every configuration's dropped-out features, and the wide SpMM input when it was built directly.

        Fusion of dropout and concatenation: when the features need no gradient and every configuration
        aggregates its own dropped-out copy first, each copy is written straight into its columns of the
        wide SpMM input, saving one pass over ``K x [N, F]``. The masks are the counter-based ones the solo
        run's dropout draws (same seed draw from the configuration's generator, same shape).
        """
        ps = [m.dropout if self.training else 0.0 for m in models]
        dropped = [j for j, p in enumerate(ps) if p > 0.0]
        direct = (fuse and self.training and hash_dropout.applies(x) and not x.requires_grad and len(dropped) > 1
                  and all(ps[j] < 1.0 and lp.order(j) and not lp.is_cached(j) for j in dropped)
                  and all(lp.is_cached(j) for j, p in enumerate(ps) if p == 0.0))
        if not direct:
            return [dropout(x, p, self.training, g) for p, g in zip(ps, gens)], None
        f = x.shape[1]
        wide = x.new_empty((x.shape[0], f * len(dropped)))
        hs = [x] * len(models)
        for q, j in enumerate(dropped):
            hs[j] = hash_dropout.apply_into(x, ps[j], wide[:, q * f:(q + 1) * f], gens[j])
        return hs, wide

    def _layer(self, graph: CSRGraph, x: Tensor, fam: _Family, convs: list[nn.Module], hs: list[Tensor],
               lp: LayerPlan, first: bool, prebuilt: Tensor | None = None) -> list[Tensor]:
        """One layer for every active configuration: one SpMM over the concatenated inputs."""
        n = graph.num_dst
        ew, sw, reduce = fam.agg_args(convs[0], graph)
        # Inputs of the wide SpMM. A tensor shared by several aggregate-first configurations (the features,
        # undropped, with the cache rewrite off) enters once; transform-first configurations sharing an input
        # (the features in an evaluation pass) are transformed by one matmul whose output enters as one part.
        parts: list[Tensor] = []
        pieces: list[list[int]] = []  # per part: the widths of the configurations' pieces
        where: dict[int, tuple[int, int]] = {}  # configuration position -> (part, piece)
        zs: dict[int, Tensor] = {}  # configuration position -> its pre-transformed input (GIN's root term)
        agg_input: dict[int, int] = {}  # id of an aggregate-first input -> part
        tr_groups: dict[int, list[int]] = {}
        for j, h in enumerate(hs):
            if lp.is_cached(j):
                continue
            if lp.order(j):
                if id(h) not in agg_input:
                    agg_input[id(h)] = len(parts)
                    parts.append(h)
                    pieces.append([h.shape[1]])
                where[j] = (agg_input[id(h)], 0)
            else:
                tr_groups.setdefault(id(h), []).append(j)
        for group in tr_groups.values():
            weights = [fam.pre_weight(convs[j]) for j in group]
            z = F.linear(hs[group[0]], torch.cat(weights, 0) if len(weights) > 1 else weights[0])
            widths = [w.shape[0] for w in weights]
            for q, (j, zj) in enumerate(zip(group, z.split(widths, dim=1) if len(group) > 1 else (z,))):
                zs[j] = zj
                where[j] = (len(parts), q)
            parts.append(z)
            pieces.append(widths)
        aggs: list[list[Tensor]] = []
        if parts:
            if prebuilt is not None and sum(p.shape[1] for p in parts) == prebuilt.shape[1] and all(
                    p.data_ptr() == prebuilt.data_ptr() + q * p.shape[1] * p.element_size()
                    and p.stride() == prebuilt.stride() for q, p in enumerate(parts)):
                wide = prebuilt  # the parts are its column blocks, in order
            else:
                wide = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
            out = spmm(graph, wide, ew, reduce=reduce, self_weight=sw)
            per_part = out.split([p.shape[1] for p in parts], dim=1) if len(parts) > 1 else (out,)
            aggs = [list(a.split(w, dim=1)) if len(w) > 1 else [a] for a, w in zip(per_part, pieces)]
        cached: Tensor | None = None
        results = []
        for j, (conv, h) in enumerate(zip(convs, hs)):
            if lp.is_cached(j):
                if cached is None:
                    if not first or h is not x:
                        raise AssertionError("only the undropped input features can be cached")
                    cached = self.cache.get(graph, x, f"{self.family}:{reduce}",
                                            lambda h=h: spmm(graph, h, ew, reduce=reduce, self_weight=sw))
                a = cached
            else:
                part, piece = where[j]
                a = aggs[part][piece]
            results.append(fam.post(conv, a, h, zs.get(j), lp.order(j), n))
        return results


def batch_models(models: Sequence[nn.Module], generators: Sequence[torch.Generator | None] | None = None,
                 rewrites: Sequence[str] = DEFAULT_REWRITES) -> BatchedGNN:
    """Batch solo models into one :class:`BatchedGNN` (see there)."""
    return BatchedGNN(models, generators, rewrites)
