"""trellis.dist."""
