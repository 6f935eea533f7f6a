"""Base-layer utilities shared by every layer: atomic writes, manifests, sizes, memory counters, numba flag.

Why a separate package below ``data``: these helpers were written once per layer before (six atomic
directory writers, four memory samplers, three numba flags). Living here, they may import only the
standard library, numpy, torch, numba and :mod:`trellis.errors`, so every layer can use them without
an upward import.
"""
