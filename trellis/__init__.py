"""Trellis: GNN training on graphs from thousands to billions of edges."""

__version__ = "0.1.0"
