"""trellis.data."""
