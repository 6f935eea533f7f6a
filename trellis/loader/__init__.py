"""trellis.loader."""
