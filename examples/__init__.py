"""Examples: the quickstart notebook and user-defined layers (executed and imported by the tests)."""
