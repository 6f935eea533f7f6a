"""Models built from the layers, and the registry ``build_model`` resolves names against.

A model is called as ``model(graph, x)``: ``graph`` is one :class:`CSRGraph` (full graph or a cluster)
used by every layer, or a list of per-layer graphs (a mini-batch's bipartite blocks, a partition's local
graphs), so the same model code runs under every training strategy. ``model(graph, x, view=...)`` takes a
:class:`~trellis.nn.view.GraphView` that supplies each layer's input rows (halo rows, tiles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.nn.executor import InputAggregation
from trellis.nn.layers import GATConv, GCNConv, GINConv, MessagePassing, PushdownConv, SAGEConv
from trellis.nn.view import IDENTITY, GraphView
from trellis.ops.dropout import dropout as hash_dropout
from trellis.ops.graph import CSRGraph
from trellis.ops.sparse_rows import head_rows, is_sparse, linear
from trellis.plan.ir import format_plans

Graphs = CSRGraph | Sequence[CSRGraph]


def per_layer(graph: Graphs, depth: int) -> list[CSRGraph]:
    """One graph per layer: ``graph`` repeated, or the per-layer list checked against the depth."""
    if isinstance(graph, CSRGraph):
        return [graph] * depth
    if len(graph) != depth:
        raise ValueError(f"got {len(graph)} blocks for a {depth}-layer model")
    return list(graph)


#: ``--norm`` choices: normalization after each hidden layer's aggregation.
NORMS = ("none", "layer", "batch")
#: ``--jk`` choices: jumping knowledge over the layers' outputs (Xu et al. 2018).
JKS = ("none", "cat", "max")


class GNN(nn.Module):
    """A stack of message-passing layers with dropout before each layer and an activation between them.

    Options real graphs need (Platonov et al. 2023 report GCN with residual connections and layer
    normalization on heterophilous graphs; Xu et al.'s jumping knowledge):

    * ``norm``: ``layer`` or ``batch`` normalization of each hidden layer's output, before the activation;
    * ``residual``: each hidden layer adds its (undropped) input, through a linear projection where the
      widths differ: ``h' = act(norm(conv(dropout(h)))) + skip(h)``;
    * ``jk``: every layer is hidden-wide and a final linear map reads the layers' outputs concatenated
      (``cat``) or their element-wise maximum (``max``);
    * ``pre_norm``: pre-norm residual blocks (Platonov et al. 2023's GCN; a Transformer's order). A linear
      input layer maps the features to the hidden width, ``h = act(W_in dropout(x))``; every graph layer is a
      block ``h = h + act(conv(dropout(norm(h))))``; a norm and a linear output layer read the last,
      ``W_out dropout(norm(h))``. The residual stream is never normalized, only what each block reads
      (Platonov et al.'s minesweeper, one recipe: test ROC-AUC 90.5 over 10 splits against 85.2 with the
      post-norm residual layers above and 89.75 published; docs/benchmarks.md).

    With none of them (the default) the model is the plain stack, the one model batching and out-of-core
    tiling run (:attr:`plain`).
    """

    def __init__(self, convs: Sequence[nn.Module], dropout: float = 0.5, activation: Callable = F.relu, *,
                 norm: str = "none", residual: bool = False, jk: str = "none", widths: Sequence[int] = (),
                 out_dim: int = 0, pre_norm: bool = False, in_dim: int = 0) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm {norm!r} is not one of {', '.join(NORMS)}")
        if jk not in JKS:
            raise ValueError(f"jk {jk!r} is not one of {', '.join(JKS)}")
        if pre_norm and (jk != "none" or len(set(widths)) != 1 or not in_dim or not out_dim):
            raise ValueError("pre_norm blocks are hidden-wide (widths all equal), need in_dim and out_dim, no jk")
        self.convs = nn.ModuleList(convs)
        self.dropout = dropout
        self.activation = activation
        self.norm, self.jk, self.pre_norm = norm, jk, bool(pre_norm)
        self.residual = bool(residual) and not pre_norm  # pre-norm blocks add their input themselves (post)
        # widths[i] = input width of layer i, widths[i + 1] its output width (needed by norm/residual/jk)
        hidden = range(len(convs) if jk != "none" or pre_norm else len(convs) - 1)
        if norm != "none" or residual or jk != "none" or pre_norm:
            if len(widths) != len(convs) + 1:
                raise ValueError("norm, residual, jk and pre_norm need the layer widths")
        make_norm = (lambda w: nn.LayerNorm(w)) if norm == "layer" else (lambda w: nn.BatchNorm1d(w))
        # pre-norm: norms[i] normalizes block i's input, norms[L] the output layer's
        self.norms = nn.ModuleList(make_norm(widths[i] if pre_norm else widths[i + 1])
                                   for i in (range(len(convs) + 1) if pre_norm else hidden)) \
            if norm != "none" else nn.ModuleList()
        self.encoder = nn.Linear(in_dim, widths[0]) if pre_norm else None
        self.head = nn.Linear(widths[-1], out_dim) if pre_norm else None
        self.skips = nn.ModuleList(
            nn.Identity() if widths[i] == widths[i + 1] else nn.Linear(widths[i], widths[i + 1], bias=False)
            for i in hidden) if self.residual else nn.ModuleList()
        self.jk_lin: nn.Module | None = None
        if jk != "none":
            width = widths[-1] * len(convs) if jk == "cat" else widths[-1]
            self.jk_lin = nn.Linear(width, out_dim)

    @property
    def plain(self) -> bool:
        """No normalization, residual, jumping knowledge or pre-norm blocks: the stack batching and tiling run."""
        return self.norm == "none" and not self.residual and self.jk == "none" and not self.pre_norm

    def encode(self, x: Tensor) -> Tensor:
        """The first layer's input from the feature rows: ``x`` itself, or the pre-norm input layer's output."""
        if self.encoder is None:
            return x
        return self.activation(linear(hash_dropout(x, self.dropout, self.training), self.encoder.weight,
                                      self.encoder.bias))

    def pre(self, i: int, h: Tensor) -> Tensor:
        """What layer ``i`` aggregates of its input ``h`` (before dropout): ``h``, or its norm in a pre-norm block."""
        return self.norms[i](h) if self.pre_norm and self.norm != "none" else h

    def post(self, i: int, h: Tensor, y: Tensor) -> Tensor:
        """What follows layer ``i``'s aggregation ``y`` given its input ``h``: norm, activation, residual.

        Nothing after the last layer (unless jumping knowledge makes every layer a hidden one). ``h`` holds
        the layer's destinations as its first rows (a block, a partition's owned rows, the whole graph).
        A pre-norm block adds its activated output to its input.
        """
        if self.pre_norm:
            return head_rows(h, y.shape[0]) + self.activation(y)
        if i == len(self.convs) - 1 and self.jk == "none":
            return y
        if self.norm != "none":
            y = self.norms[i](y)
        y = self.activation(y)
        if self.residual:
            rows = head_rows(h, y.shape[0])  # a first layer's input may be sparse bag-of-words rows
            skip = self.skips[i]
            if isinstance(skip, nn.Linear):
                y = y + linear(rows, skip.weight)
            else:
                y = y + (rows.to_dense() if is_sparse(rows) else rows)
        return y

    def jk_inputs(self, outs: Sequence[Tensor]) -> Tensor:
        """The layers' outputs combined (``cat`` or ``max``) on the final destinations (their first rows)."""
        n = outs[-1].shape[0]
        if self.jk == "cat":
            return torch.cat([o[:n] for o in outs], 1)
        return torch.stack([o[:n] for o in outs]).amax(0)

    def readout(self, outs: Sequence[Tensor]) -> Tensor:
        """The model's output from the layers' outputs.

        The last one, jumping knowledge's linear map of them all, or the pre-norm output layer.
        """
        if self.head is not None:
            h = self.norms[-1](outs[-1]) if self.norm != "none" else outs[-1]
            return self.head(hash_dropout(h, self.dropout, self.training))
        if self.jk_lin is None:
            return outs[-1]
        return self.jk_lin(hash_dropout(self.jk_inputs(outs), self.dropout, self.training))

    def forward(self, graph: Graphs, x: Tensor, return_embedding: bool = False,
                view: GraphView | None = None) -> Tensor:
        """Logits for every destination node (or the last hidden layer's output with ``return_embedding``).

        Args:
            graph: One graph for every layer, or one per layer.
            x: The first layer's input rows (all its sources, or only the owned rows when ``view`` adds the rest).
            return_embedding: Return the last layer's input (before its dropout and view) instead.
            view: Supplies each layer's input rows after its dropout (default: the identity).
        """
        view = IDENTITY if view is None else view
        outs: list[Tensor] = []
        x = self.encode(x)
        for i, (conv, g) in enumerate(zip(self.convs, per_layer(graph, len(self.convs)))):
            if return_embedding and i == len(self.convs) - 1 and self.jk == "none" and not self.pre_norm:
                return x
            h = x
            x = hash_dropout(self.pre(i, x), self.dropout, self.training)
            x = self.post(i, h, conv(g, view.layer_input(i, g, x)))
            if self.jk != "none":
                outs.append(x)
        if self.jk != "none":
            return self.jk_inputs(outs) if return_embedding else self.readout(outs)
        if self.pre_norm:
            return x if return_embedding else self.readout([x])
        return x

    def explain(self, graph: Graphs) -> str:
        """The operator plan of every layer with estimated FLOPs and bytes."""
        plans = []
        for conv, g in zip(self.convs, per_layer(graph, len(self.convs))):
            if isinstance(conv, MessagePassing):
                if isinstance(conv, GATConv):
                    g = g.with_self_loops()
                plans.append(conv.plan(g))
        return format_plans(plans)


def input_aggregation(model: nn.Module) -> InputAggregation | None:
    """``model``'s first-layer aggregation of constant input rows, when that layer is pushed down (GCN, SAGE, GIN).

    What a partition buffer's kept rehearsal batch precomputes (:class:`trellis.loader.buffer.Kept`); None for a
    model whose first layer reads its sources otherwise (attention, a user layer, an MLP).
    """
    if isinstance(model, GNN) and isinstance(model.convs[0], PushdownConv) and not model.pre_norm:
        return InputAggregation(model.convs[0])
    return None


class GAT(GNN):
    """GAT uses ELU between layers (Veličković et al.)."""

    def __init__(self, convs: Sequence[nn.Module], dropout: float = 0.6, **options: Any) -> None:
        super().__init__(convs, dropout, F.elu, **options)


class MLP(nn.Module):
    """Graph-agnostic baseline: the same call signature, the graph is ignored."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, graph: Graphs, x: Tensor, return_embedding: bool = False,
                view: GraphView | None = None) -> Tensor:
        """Logits of the destination rows of ``x`` (a graph view is not needed: no neighbour is read)."""
        n = graph.num_dst if isinstance(graph, CSRGraph) else graph[-1].num_dst
        x = x[:n]
        for i, lin in enumerate(self.lins):
            if return_embedding and i == len(self.lins) - 1:
                return x
            x = lin(hash_dropout(x, self.dropout, self.training))
            if i < len(self.lins) - 1:
                x = F.relu(x)
        return x

    def explain(self, graph: Graphs) -> str:
        """No graph ops to plan."""
        return "mlp: dense layers only, no graph ops"


def _dims(in_dim: int, hidden: int, out_dim: int, layers: int) -> list[tuple[int, int]]:
    dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    return list(zip(dims[:-1], dims[1:]))


def _stack(make: Callable[[int, int], nn.Module], in_dim: int, out_dim: int, *, hidden: int, layers: int,
           dropout: float, norm: str = "none", residual: bool = False, jk: str = "none",
           pre_norm: bool = False) -> GNN:
    """A :class:`GNN` of ``make(in, out)`` layers (every one ``hidden`` wide with jumping knowledge or pre-norm)."""
    if pre_norm:
        widths = [hidden] * (layers + 1)
    else:
        widths = [in_dim] + [hidden] * (layers if jk != "none" else layers - 1) + ([] if jk != "none" else [out_dim])
    convs = [make(a, b) for a, b in zip(widths[:-1], widths[1:])]
    return GNN(convs, dropout, norm=norm, residual=residual, jk=jk, widths=widths, out_dim=out_dim,
               pre_norm=pre_norm, in_dim=in_dim)


def _gcn(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, norm: str = "none",
         residual: bool = False, jk: str = "none", edge_weight: bool = False, pre_norm: bool = False,
         **_: object) -> nn.Module:
    return _stack(lambda a, b: GCNConv(a, b, edge_weight=edge_weight), in_dim, out_dim, hidden=hidden,
                  layers=layers, dropout=dropout, norm=norm, residual=residual, jk=jk, pre_norm=pre_norm)


def _sage(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, norm: str = "none",
          residual: bool = False, jk: str = "none", edge_weight: bool = False, pre_norm: bool = False,
          **_: object) -> nn.Module:
    return _stack(lambda a, b: SAGEConv(a, b, edge_weight=edge_weight), in_dim, out_dim, hidden=hidden,
                  layers=layers, dropout=dropout, norm=norm, residual=residual, jk=jk, pre_norm=pre_norm)


def _gin(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, norm: str = "none",
         residual: bool = False, jk: str = "none", mlp_hidden: int = 0, pre_norm: bool = False,
         **_: object) -> nn.Module:
    return _stack(lambda a, b: GINConv(a, b, mlp_hidden=mlp_hidden or None), in_dim, out_dim, hidden=hidden,
                  layers=layers, dropout=dropout, norm=norm, residual=residual, jk=jk, pre_norm=pre_norm)


def _gat_stack(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float,
               out_heads: int = 1, edge_dim: int = 0, attn_dropout: float | None = None, norm: str = "none",
               residual: bool = False, jk: str = "none") -> nn.Module:
    ad = dropout if attn_dropout is None else attn_dropout
    convs: list[nn.Module] = []
    widths = [in_dim]
    for _ in range(layers - 1 if jk == "none" else layers):
        convs.append(GATConv(widths[-1], hidden, heads, concat=True, dropout=ad, edge_dim=edge_dim))
        widths.append(hidden * heads)
    if jk == "none":
        convs.append(GATConv(widths[-1], out_dim, out_heads, concat=False, dropout=ad, edge_dim=edge_dim))
        widths.append(out_dim)
    return GAT(convs, dropout, norm=norm, residual=residual, jk=jk, widths=widths, out_dim=out_dim)


def _gat(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float,
         out_heads: int = 1, attn_dropout: float | None = None, norm: str = "none", residual: bool = False,
         jk: str = "none", **_: object) -> nn.Module:
    return _gat_stack(in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                      out_heads=out_heads, attn_dropout=attn_dropout, norm=norm, residual=residual, jk=jk)


def _gate(in_dim: int, out_dim: int, *, hidden: int, layers: int, heads: int, dropout: float, edge_dim: int = 0,
          out_heads: int = 1, attn_dropout: float | None = None, norm: str = "none", residual: bool = False,
          jk: str = "none", **_: object) -> nn.Module:
    if edge_dim <= 0:
        raise ValueError("gate (GAT with edge features) needs a graph with edge features")
    return _gat_stack(in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                      out_heads=out_heads, edge_dim=edge_dim, attn_dropout=attn_dropout, norm=norm,
                      residual=residual, jk=jk)


def _mlp(in_dim: int, out_dim: int, *, hidden: int, layers: int, dropout: float, **_: object) -> nn.Module:
    return MLP(in_dim, hidden, out_dim, layers, dropout)


#: Model registry: name -> builder. A new model is one builder registered here.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "gcn": _gcn,
    "sage": _sage,
    "gin": _gin,
    "gat": _gat,
    "gate": _gate,
    "mlp": _mlp,
}
_BUILTIN = frozenset(MODELS)
#: Models whose first layer takes sparse input rows (its dropout and transform, :mod:`trellis.ops.sparse_rows`).
SPARSE_ROW_MODELS = frozenset({"gcn", "sage", "gin", "gat", "gate"})


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of Trellis's own models (every process knows it without a registration)."""
    return name in _BUILTIN
#: The options every built-in builder is handed (``trellis train`` flags, not ``--model-args``).
MODEL_FLAGS = ("hidden", "layers", "heads", "dropout", "edge_dim", "norm", "residual", "jk", "mlp_hidden",
               "edge_weight", "pre_norm")


def refuse_unknown_options(name: str, builder: Callable[..., Any], options: dict[str, Any],
                           common: Sequence[str] = ()) -> None:
    """Refuse an option ``builder`` does not name (a built-in builder would swallow it: a typo trains silently).

    ``common`` are the options every builder is handed whether it reads them or not; the message lists the rest.

    Raises:
        ValueError: Names the option and what ``--model-args`` accepts for ``name``.
    """
    import inspect

    own = [p.name for p in inspect.signature(builder).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(own))
    if unknown:
        extra = [n for n in own if n not in common]
        raise ValueError(f"{name} has no option {unknown[0]!r} (--model-args); "
                         + (f"it takes {', '.join(extra)}" if extra else "it takes none beyond its flags"))


def register_model(name: str, builder: Callable[..., nn.Module]) -> None:
    """Register a user's model builder ``(in_dim, out_dim, **hparams) -> Module`` under ``name``.

    The builder receives only the keyword options its signature names (all of them if it takes
    ``**kwargs``), so ``def my_model(in_dim, out_dim, hidden=32)`` works with every strategy's options. A
    process that trains the model (a spawned rank, a sampler) must register it too, as it imports its models.
    """
    import inspect

    if name in _BUILTIN and MODELS.get(name) is not builder:
        raise ValueError(f"{name!r} is a built-in model; choose another name")
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        MODELS[name] = builder
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        MODELS[name] = builder
        return

    def build(in_dim: int, out_dim: int, **kwargs: Any) -> nn.Module:
        return builder(in_dim, out_dim, **{k: v for k, v in kwargs.items() if k in params})

    build.__wrapped__ = builder  # type: ignore[attr-defined]
    MODELS[name] = build


def build_model(name: str, in_dim: int, out_dim: int, *, hidden: int = 64, layers: int = 2, heads: int = 1,
                dropout: float = 0.5, edge_dim: int = 0, **extra: object) -> nn.Module:
    """Build a registered model.

    Args:
        name: One of :data:`MODELS` (gcn, sage, gin, gat, gate, mlp).
        in_dim: Input feature width.
        out_dim: Output width (classes).
        hidden: Hidden width (per head for attention models) (default: 64).
        layers: Number of layers (default: 2).
        heads: Attention heads of hidden layers (default: 1).
        dropout: Dropout before every layer (and on attention coefficients) (default: 0.5).
        edge_dim: Edge feature width, for models that read edge features (default: 0).
        **extra: Model-specific options (``out_heads``, ``attn_dropout``).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if layers < 1:
        raise ValueError("a model needs at least one layer")
    if name in _BUILTIN:
        refuse_unknown_options(name, MODELS[name], extra, common=MODEL_FLAGS)
    return MODELS[name](in_dim, out_dim, hidden=hidden, layers=layers, heads=heads, dropout=dropout,
                        edge_dim=edge_dim, **extra)
