"""trellis.plan."""
