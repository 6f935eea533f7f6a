"""Layers that execute their plans, and the models built from them.

``build_model(name, in_dim, out_dim, **hparams)`` is the registry entry point; every model is called as
``model(graph, x)`` with a :class:`trellis.ops.graph.CSRGraph` (or a list of per-layer graphs) and node
features, returning one row per destination node; ``view=`` (a :class:`GraphView`) supplies each layer's
input rows where they are not all local (halo rows, tiles). A layer declares itself with a
:class:`trellis.plan.LayerDecl`.
"""

from trellis.nn.layers import GATConv, GCNConv, GINConv, MessagePassing, PushdownConv, SAGEConv
from trellis.nn.models import GNN, MLP, MODELS, build_model, register_model
from trellis.nn.view import IDENTITY, GraphView, IdentityView

__all__ = ["GATConv", "GCNConv", "GINConv", "GNN", "GraphView", "IDENTITY", "IdentityView", "MLP", "MODELS",
           "MessagePassing", "PushdownConv", "SAGEConv", "build_model", "register_model"]
