"""trellis.ops."""
