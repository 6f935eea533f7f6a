"""trellis.train."""
