"""Layers declared as message / aggregate / update, and the models built from them.

``build_model(name, in_dim, out_dim, **hparams)`` is the registry entry point; every model is called as
``model(graph, x)`` with a :class:`trellis.ops.graph.CSRGraph` (or a list of per-layer blocks) and node
features, returning one row per destination node.
"""

from trellis.nn.decl import LayerDecl
from trellis.nn.layers import GATConv, GCNConv, GINConv, MessagePassing, SAGEConv
from trellis.nn.models import GNN, MLP, MODELS, build_model

__all__ = ["GATConv", "GCNConv", "GINConv", "GNN", "LayerDecl", "MLP", "MODELS", "MessagePassing", "SAGEConv",
           "build_model"]
