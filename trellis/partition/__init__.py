"""trellis.partition."""
