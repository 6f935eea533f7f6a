"""trellis.nn."""
