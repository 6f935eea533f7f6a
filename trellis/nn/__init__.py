"""Layers declared as message / aggregate / update, and the models built from them.

``build_model(name, in_dim, out_dim, **hparams)`` is the registry entry point; every model is called as
``model(graph, x)`` with a :class:`trellis.ops.graph.CSRGraph` and node features, returning one row per
destination node.
"""
