"""trellis.cli."""
