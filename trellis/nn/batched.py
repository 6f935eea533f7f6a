"""Model batching: K configurations of one model family and depth run as one model (Lotan §5.2).

Why: a hyperparameter sweep trains many models on the same graph, and each of them reads the whole graph
in every layer of every step. Here the K configurations' inputs of a layer are concatenated along the
feature axis, so each layer runs **one** SpMM that reads every edge once for all K (the graph engine's
random row accesses, its index and weight reads, and its launches are shared), while every
configuration keeps its own transforms, hidden size, dropout rate and random stream. Each configuration
also keeps its order of transform and aggregation (the planner picks it from that configuration's widths),
and configurations whose first-layer input is the constant feature matrix share one cached ``Â X``
(:mod:`trellis.plan.rewrites`, :mod:`trellis.nn.runtime`). Each layer runs through the one executor of a
layer's plan (:func:`trellis.nn.executor.run_layer`), the same one a layer's own ``forward`` calls; the
layer classes supply the math.

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
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.nn.executor import run_layer
from trellis.nn.layers import PUSHDOWN_LAYERS, MessagePassing, PushdownConv
from trellis.nn.models import GNN, Graphs, per_layer
from trellis.nn.runtime import AggregationCache, bias_act_dropout, default_generator, dropout
from trellis.nn.view import IDENTITY, GraphView
from trellis.ops import dropout as hash_dropout
from trellis.ops.graph import CSRGraph
from trellis.plan import GraphStats
from trellis.plan.ir import LayerPlan, ModelDecl, ModelPlan
from trellis.plan.planner import check_batchable, plan_model
from trellis.plan.rewrites import DEFAULT_REWRITES, FUSE


def capture_generator(device: torch.device | str) -> torch.Generator:
    """A generator in the current state of ``device``'s default generator.

    Called right after a configuration's solo model has been built (after ``seed_everything(seed)`` and
    ``make_model``, as the trainer does), it starts where the solo run's dropout would start drawing.
    """
    device = torch.device(device)
    g = torch.Generator(device=device)
    g.set_state(default_generator(device).get_state())
    return g


def family_of(model: nn.Module) -> str:
    """The model family of a GNN whose layers can be batched (``gcn``, ``sage``, ``gin``).

    Raises:
        TrellisUserError: The model is not a batchable GNN (e.g. GAT, MLP) or mixes layer types.
    """
    convs = getattr(model, "convs", None)
    batchable = ", ".join(sorted(PUSHDOWN_LAYERS))
    if not isinstance(model, GNN) or convs is None or type(model) is not GNN:
        raise TrellisUserError(f"{type(model).__name__} cannot be model-batched; batchable families: {batchable}")
    names = {c.family if isinstance(c, PushdownConv) or (isinstance(c, MessagePassing) and c.user_defined
                                                        and c.pushdown) else None for c in convs}
    if None in names or len(names) != 1:
        kinds = ", ".join(sorted({type(c).__name__ for c in convs}))
        raise TrellisUserError(f"a model with layers {kinds} cannot be model-batched; batchable families: {batchable}")
    if model.activation is not F.relu:
        raise TrellisUserError("model batching supports ReLU between layers only")
    if model.pre_norm:
        raise TrellisUserError("--pre-norm blocks (an input and an output layer around the graph layers) run one "
                               "configuration at a time")
    return names.pop()  # type: ignore[return-value]


def check_tileable(model: nn.Module) -> str:
    """:func:`family_of` for the out-of-core engine, which runs the plain stack without edge weights.

    Raises:
        TrellisUserError: What :func:`family_of` refuses, normalization, residual connections, jumping
            knowledge, pre-norm blocks or edge weights.
    """
    not_plain = TrellisUserError("a model with --norm, --residual, --jk or --pre-norm runs whole-graph in memory, on "
                                 "mini- or cluster-batches and across ranks; out-of-core tiles run the plain layer "
                                 "stack (drop those options there)")
    if getattr(model, "pre_norm", False):  # before family_of, which would say why it cannot batch
        raise not_plain
    family = family_of(model)
    if family not in PUSHDOWN_LAYERS:
        raise TrellisUserError(f"{family.removeprefix('user:')}: out-of-core tiles run the built-in GCN, SAGE and GIN "
                               "layers (a user layer's aggregation is its own code); drop --memory-budget")
    if not cast(GNN, model).plain:
        raise not_plain
    if any(getattr(c, "edge_weight", False) for c in cast(GNN, model).convs):
        raise TrellisUserError("--edge-weight runs whole-graph in memory and on mini- or cluster-batches; out-of-core "
                               "tiles aggregate without edge weights (drop --edge-weight there)")
    return family


def model_decl(model: nn.Module, family: str | None = None) -> ModelDecl:
    """The planner's view of one configuration (its layers' declarations and its dropout).

    Raises:
        TrellisUserError: The model is not a batchable GNN (see :func:`family_of`).
    """
    family = family or family_of(model)
    model = cast(GNN, model)
    layers = tuple(cast(PushdownConv, c).declare() for c in model.convs)
    return ModelDecl(family, layers, float(model.dropout))


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
        self.decls = [model_decl(m, f) for m, f in zip(models, families)]
        check_batchable(self.decls)
        if len({bool(getattr(m.convs[0], "edge_weight", False)) for m in models}) > 1:  # type: ignore[index]
            raise TrellisUserError("configurations with and without --edge-weight aggregate differently and cannot "
                                   "share a batch")
        self.family = families[0]
        self.models = nn.ModuleList(models)
        self._gnns = [cast(GNN, m) for m in models]  # the same modules, typed
        self.generators = list(generators) if generators is not None else [None] * len(models)
        if len(self.generators) != len(models):
            raise ValueError("one generator per configuration")
        self.rewrites = tuple(rewrites)
        self.active: list[int] = list(range(len(models)))
        self.cache = AggregationCache()
        self._plans: dict[tuple, ModelPlan] = {}
        #: Statistics to plan from instead of each graph's own: a distributed rank plans from the whole
        #: graph's, so that every rank picks the same order per layer (and so the same exchange widths).
        self.stats: GraphStats | None = None

    @property
    def depth(self) -> int:
        """Number of layers of every configuration."""
        return self.decls[0].depth

    def drop(self, k: int) -> None:
        """Remove configuration ``k`` (an index into the original list) from the batch: it stopped."""
        if k in self.active:
            self.active.remove(k)

    def plan(self, graph: CSRGraph, training: bool | None = None, input_grad: bool = False) -> ModelPlan:
        """The plan of the active configurations on ``graph`` (cached per graph shape, mode and batch)."""
        training = self.training if training is None else training
        stats = self.stats if self.stats is not None else GraphStats.of(graph)
        key = (stats, tuple(self.active), training, input_grad)
        if key not in self._plans:
            self._plans[key] = plan_model([self.decls[k] for k in self.active], stats, training=training,
                                          rewrites=self.rewrites, input_grad=input_grad)
        return self._plans[key]

    def explain(self, graph: CSRGraph) -> str:
        """Training-step and evaluation-pass plans of the active configurations."""
        return f"{self.plan(graph, True).format()}\n\n{self.plan(graph, False).format()}"

    def forward(self, graph: Graphs, x: Tensor, view: GraphView | None = None) -> list[Tensor]:
        """Logits of every active configuration (a list in :attr:`active` order).

        Args:
            graph: One graph for every layer, or one per layer (each layer is planned on its own graph).
            x: The first layer's input rows.
            view: Supplies each layer's input rows after its dropout, once per distinct input tensor
                (default: the identity).
        """
        if not self.active:
            return []
        view = IDENTITY if view is None else view
        graphs = per_layer(graph, self.depth)
        models = [self._gnns[k] for k in self.active]
        gens = [self.generators[k] for k in self.active]
        # One model plan per distinct graph; layer i runs layer i of its graph's plan.
        by_graph = {g: self.plan(g, self.training, x.requires_grad) for g in dict.fromkeys(graphs)}
        plans = [by_graph[g].layers[i] for i, g in enumerate(graphs)]
        fuse = FUSE in by_graph[graphs[0]].rewrites
        hs, wide0 = self._first_inputs(x, models, gens, plans[0], fuse)
        raws: list[Tensor] = [x] * len(models)  # undropped layer inputs (residual connections read them)
        jk: list[list[Tensor]] = [[] for _ in models]
        for i, (g, lp) in enumerate(zip(graphs, plans)):
            convs = [cast(PushdownConv, m.convs[i]) for m in models]
            hs, constant = _view_inputs(view, i, g, hs, x if i == 0 else None)
            outs = run_layer(convs, g, hs, lp, cache=self.cache if constant is x else None, constant=constant,
                             prebuilt=wide0 if i == 0 else None)
            last = i == self.depth - 1
            results, hs, next_raws = [], [], []
            for k, (o, c, m, gen) in enumerate(zip(outs, convs, models, gens)):
                b = c.output_bias()
                if not m.plain:  # the solo model's own post-processing, then its dropout stream's next mask
                    y = m.post(i, raws[k], o + b if b is not None else o)
                    if m.jk != "none":
                        jk[k].append(y)
                    if last:
                        results.append(y if m.jk_lin is None else
                                       m.jk_lin(dropout(m.jk_inputs(jk[k]), m.dropout, self.training, gen)))
                    else:
                        next_raws.append(y)
                        hs.append(dropout(y, m.dropout, self.training, gen))
                elif last:
                    results.append(o + b if b is not None else o)
                elif fuse:
                    next_raws.append(x)  # unused: a plain model has no residual
                    hs.append(bias_act_dropout(o, b, act=True, p=m.dropout, training=self.training, generator=gen))
                else:
                    next_raws.append(x)
                    hs.append(dropout(F.relu(o + b if b is not None else o), m.dropout, self.training, gen))
            if last:
                return results
            raws = next_raws
        raise AssertionError("unreachable")

    def _first_inputs(self, x: Tensor, models: list[GNN], gens: list[torch.Generator | None],
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


def _view_inputs(view: GraphView, layer: int, graph: CSRGraph, hs: list[Tensor],
                 constant: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
    """Every configuration's input through the view, once per distinct tensor (shared inputs stay shared).

    Returns:
        The viewed inputs and what ``constant`` became (``constant`` itself under the identity view, so the
        cached aggregation of the features is still found).
    """
    seen: dict[int, Tensor] = {}
    out = []
    for h in hs:
        if id(h) not in seen:
            seen[id(h)] = view.layer_input(layer, graph, h)
        out.append(seen[id(h)])
    if constant is not None:
        constant = seen.get(id(constant), constant)
    return out, constant


def batch_models(models: Sequence[nn.Module], generators: Sequence[torch.Generator | None] | None = None,
                 rewrites: Sequence[str] = DEFAULT_REWRITES) -> BatchedGNN:
    """Batch solo models into one :class:`BatchedGNN` (see there)."""
    return BatchedGNN(models, generators, rewrites)
