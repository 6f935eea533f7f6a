"""Hypothesis strategies and dense references shared by the ops tests."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st

from trellis.ops import WITH_NUMBA, use_numba
from trellis.ops.graph import CSRGraph

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
BACKENDS = ["numba", "torch"] if WITH_NUMBA else ["torch"]


def backend(name: str):
    """Context forcing the numba kernels (``"numba"``) or the pure-torch path (``"torch"``)."""
    return use_numba(name == "numba") if WITH_NUMBA or name == "torch" else contextlib.nullcontext()


def make_graph(dst: np.ndarray, src: np.ndarray, num_dst: int, num_src: int) -> CSRGraph:
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(num_dst + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_dst), out=indptr[1:])
    return CSRGraph.from_numpy(indptr, src[order].astype(np.int64), num_src)


@st.composite
def graphs(draw, max_dst: int = 8, max_extra_src: int = 3, max_edges: int = 30, square: bool = False):
    """Small random graphs with isolated destinations, self loops, duplicate edges and bipartite shapes."""
    nd = draw(st.integers(1, max_dst))
    ns = nd if square else nd + draw(st.integers(0, max_extra_src))
    e = draw(st.integers(0, max_edges))
    dst = draw(st.lists(st.integers(0, nd - 1), min_size=e, max_size=e))
    src = draw(st.lists(st.integers(0, ns - 1), min_size=e, max_size=e))
    if e and draw(st.booleans()):  # a duplicate edge
        dst.append(dst[0])
        src.append(src[0])
    if draw(st.booleans()):  # a self loop
        i = draw(st.integers(0, nd - 1))
        dst.append(i)
        src.append(i)
    seed = draw(st.integers(0, 2**31 - 1))
    return make_graph(np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64), nd, ns), seed


def edges(g: CSRGraph) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst, src) of every edge in CSR order."""
    return g.dst_of_edges(), g.indices


def random_graph(num_dst: int, num_src: int, num_edges: int, seed: int = 0, power: float = 0.0) -> CSRGraph:
    """A larger random graph (optionally with power-law in-degrees) for numba-vs-torch checks."""
    rng = np.random.default_rng(seed)
    if power:
        p = 1.0 / np.arange(1, num_dst + 1) ** power
        dst = rng.permutation(num_dst)[rng.choice(num_dst, num_edges, p=p / p.sum())]
    else:
        dst = rng.integers(0, num_dst, num_edges)
    return make_graph(dst, rng.integers(0, num_src, num_edges), num_dst, num_src)
