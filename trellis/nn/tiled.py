"""The out-of-core executor: a GCN / SAGE / GIN model run layer by layer over row tiles, with spill files.

Why layer by layer: a full-batch step needs every node's row of layer ``l`` before any row of layer
``l + 1`` (each destination reads arbitrary sources), so the unit that can leave memory is a layer's
``[N, d]`` tensor, not a batch. Forward runs each layer over destination tiles of the in-edge CSR; the
aggregation reads source rows from a memory map (features or the previous layer's spill), the layer's own
epilogue (:meth:`~trellis.nn.layers.PushdownConv.epilogue`, bias, fused ReLU and dropout) runs on the
tile, and the tile's output and aggregation are written to spill files. Backward walks the layers in
reverse: the dense epilogue of every destination tile is recomputed under autograd from its spilled
inputs (parameter gradients accumulate tile by tile), and the aggregation's gradient runs over *source*
tiles of the reverse CSR, reading the spilled gradient rows.

Exactness: the same layer objects, the same plan (the in-memory run's per-layer order from
:func:`trellis.plan.planner.plan_model`), the same aggregation kernel over rows of the same CSRs
(:mod:`trellis.ops.tiled`), and the same dropout masks — one seed drawn per tensor in the in-memory order,
applied per tile with :func:`trellis.ops.dropout.tile_seed`. Each row is computed by the same operations
as in memory; only sums over all rows (weight and bias gradients) are accumulated tile by tile, which
moves their last bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.nn.batched import check_tileable, model_decl
from trellis.nn.layers import PushdownConv
from trellis.nn.models import GNN
from trellis.nn.runtime import bias_act_dropout
from trellis.ops import dropout as hash_dropout
from trellis.ops.sparse_rows import MappedSparseRows, linear, unmemoized
from trellis.ops.tiled import MappedCSR, iter_tiles
from trellis.plan.cost import GraphStats
from trellis.plan.decl import LayerDecl
from trellis.plan.ir import ModelPlan
from trellis.plan.outofcore import LayerShape, sparse_row_floats
from trellis.plan.planner import plan_model
from trellis.utils.spill import SpillDir, drop_map_cache, prefetch_rows


def aggregation_kind(decl: LayerDecl) -> str:
    """The tiled aggregation of a pushed-down layer: ``gcn``, ``mean`` or ``sum``.

    Raises:
        TrellisUserError: A reduce the tiled engine does not run (max needs argmax routing).
    """
    if decl.root == "self_loop" and decl.message == "weighted" and decl.aggregate == "sum":
        return "gcn"
    if decl.message == "copy" and decl.aggregate in ("mean", "sum"):
        return decl.aggregate
    raise TrellisUserError(f"{decl.name} with {decl.aggregate} aggregation cannot run out of core (tiled "
                           "engine: GCN, SAGE mean, GIN); drop --memory-budget")


class HaloRows(Protocol):
    """A distributed rank's halo rows (:class:`trellis.distributed.halo.MappedHalo`).

    The engine computes the ``L`` owned rows of each ``[L + H, d]`` tensor; this fills the rest, and sends
    the halo rows' gradients back to their owners.
    """

    num_local: int
    #: ``int64 [L]`` global id of each owned row: dropout masks are keyed by them.
    keys: np.ndarray

    def fill(self, arr: np.ndarray, layer: int = 0) -> None:
        """Rows ``L..L+H`` of ``arr`` from their owners (rows ``:L`` written)."""
        ...

    def add_back(self, arr: np.ndarray, layer: int = 0) -> None:
        """Add the gradient rows ``L..L+H`` of every rank's ``arr`` at their owners' rows."""
        ...


def output_width(conv: nn.Module) -> int:
    """A layer's output width.

    Its declaration's, except GIN's, which declares its MLP's hidden width (the width its transform, aggregation
    and root term run at, ``--mlp-hidden``) and outputs ``out_dim``.
    """
    decl = cast(PushdownConv, conv).declare()
    return int(getattr(conv, "out_dim", decl.out_dim))


def layer_shapes(model: nn.Module, stats: GraphStats) -> list[LayerShape]:
    """The memory plan's view of a batchable model's layers (training order)."""
    plan = plan_model([model_decl(model)], stats, training=True, input_grad=False)
    gnn = cast(GNN, model)
    out = []
    for i, (conv, lp) in enumerate(zip(gnn.convs, plan.layers)):
        d = cast(PushdownConv, conv).declare()
        sparse = sparse_row_floats(stats.sparse_input, d.in_dim) if (i == 0 and stats.sparse_input is not None) else 0.0
        out.append(LayerShape(d.in_dim, max(d.out_dim, output_width(conv)), lp.order(0), d.root in ("linear", "eps"),
                              sparse_in=sparse))
    return out


@dataclass
class EpochIO:
    """Spill traffic of one pass (bytes)."""

    written: int = 0
    read: int = 0
    gathered: int = 0


def root_reads(root: str | None, aggregate_first: bool) -> tuple[bool, bool]:
    """Whether a layer's epilogue reads its input rows, and whether it reads its transformed rows.

    SAGE's root reads the input rows, as does GIN aggregating first; GIN transforming first reads the
    transformed rows instead.
    """
    uses_z = root == "eps" and not aggregate_first
    return root in ("linear", "eps") and not uses_z, uses_z


#: The first layer's input: dense rows (a memory map or an array in RAM) or sparse rows in memory maps.
Input = np.ndarray | MappedSparseRows


def prefetch_input(a: Input, r0: int, r1: int) -> None:
    """Read rows ``[r0, r1)`` of ``a`` ahead (:func:`~trellis.utils.spill.prefetch_rows`; sparse rows: their span)."""
    if isinstance(a, MappedSparseRows):
        lo, hi = a.span(r0, r1)
        prefetch_rows(a.indptr, r0, r1 + 1)
        prefetch_rows(a.indices, lo, hi)
        prefetch_rows(a.values, lo, hi)
    else:
        prefetch_rows(a, r0, r1)


def _t(a: np.ndarray) -> Tensor:
    """A tensor over a tile's rows of a memory map, copied (the map may be read-only; tiles are small)."""
    return torch.from_numpy(np.array(a, dtype=np.float32))


class TiledGNN:
    """Runs a batchable GNN (GCN, SAGE mean, GIN) out of core: forward, backward, inference.

    Args:
        model: The model (its layers and parameters are used; nothing is copied).
        graph: The memory-mapped CSR and its reverse.
        x: The first layer's input ``[N, F]`` float32 (a memory map, or an array in RAM), or sparse rows in memory
            maps (bag-of-words features; the plan then transforms the first layer first: ``stats.sparse_input``).
        spill: Where ``[N, d]`` tensors are written.
        bounds: Row boundaries of the tiles (:meth:`MappedCSR.tile_bounds`).
        cold: Drop the page cache of the spills, the CSRs and the input before every pass, so that each pass
            reads from storage (benchmarks: what an epoch costs when the spills do not fit the page cache).
        halo: A distributed rank's halo rows (default: None, the whole graph). Then ``graph`` is the rank's
            part (``L`` destination rows over ``L + H`` sources), ``x`` has ``L + H`` rows with the halo rows
            filled, tiles cover the ``L`` owned rows, ``source_bounds`` the ``L + H`` rows of the backward
            aggregation, and dropout masks are keyed by global id.
        source_bounds: Tiles of the reverse CSR's rows (with ``halo``).
        stats: The statistics the plan is made from (default: ``graph``'s); a rank passes the whole graph's,
            so every rank picks the single process's order per layer and exchanges at the same width.
    """

    def __init__(self, model: nn.Module, graph: MappedCSR, x: Input, spill: SpillDir,
                 bounds: np.ndarray, *, cold: bool = False, halo: HaloRows | None = None,
                 source_bounds: np.ndarray | None = None, stats: GraphStats | None = None) -> None:
        check_tileable(model)  # refuses a model that cannot run from its plan
        self.model = cast(GNN, model)
        self.convs = [cast(PushdownConv, c) for c in self.model.convs]
        self.decls = [c.declare() for c in self.convs]
        #: Each layer's output width (GIN's ``decl.out_dim`` is its MLP's hidden width, the transformed rows').
        self.out_widths = [output_width(c) for c in self.convs]
        self.kinds = [aggregation_kind(d) for d in self.decls]
        self.roots = [d.root for d in self.decls]
        self.graph, self.x, self.spill, self.bounds = graph, x, spill, bounds
        self.stats = stats or GraphStats(graph.num_nodes, graph.num_nodes, graph.num_edges)
        self._plans: dict[bool, ModelPlan] = {}
        self.io = EpochIO()
        self.cold = cold
        self.halo, self.source_bounds = halo, bounds if source_bounds is None else source_bounds
        self._maps = [graph.indptr, graph.indices, graph.rev_indptr, graph.rev_indices,
                      *(x.maps if isinstance(x, MappedSparseRows) else (x,))]
        #: The first layer's dropout (rate, seed) when its dropped-out input is recomputed per tile.
        self._drop0: tuple[float, int] | None = None
        #: Evaluation writes every layer's output to its spill (``h{i}``), even where the next layer takes its
        #: transformed rows straight from the pass (embeddings read from the spill afterwards).
        self.keep_outputs = False

    def plan(self, training: bool) -> ModelPlan:
        """The in-memory run's plan (per-layer order, cached first aggregation) for this mode."""
        if training not in self._plans:
            self._plans[training] = plan_model([model_decl(self.model)], self.stats, training=training,
                                               input_grad=False)
        return self._plans[training]

    def _reads(self, i: int, aggregate_first: bool) -> tuple[bool, bool]:
        """Whether layer ``i``'s epilogue reads its input rows, and whether it reads the transformed rows."""
        return root_reads(self.roots[i], aggregate_first)

    # ---- tiles and spills --------------------------------------------------------------------------
    def _pass(self, arrays: Sequence[Input | None], bounds: np.ndarray | None = None
              ) -> Iterator[tuple[int, int]]:
        """The tiles ``(r0, r1)`` of one pass; the kernel reads the next tile's rows of ``arrays`` ahead.

        With ``cold``, the page cache of the spills, the CSRs and the input is dropped first.
        """
        if self.cold:
            self.spill.drop_cache()
            for m in self._maps:
                drop_map_cache(m)
        tiles = list(iter_tiles(self.bounds if bounds is None else bounds))
        for k, (r0, r1) in enumerate(tiles):
            if k + 1 < len(tiles):
                for a in arrays:
                    if a is not None:
                        prefetch_input(a, *tiles[k + 1])
            yield r0, r1

    def _read(self, arr: np.ndarray, r0: int, r1: int) -> Tensor:
        """Rows ``[r0, r1)`` of ``arr``: a view of a (writable) spill map, a copy of a read-only store map."""
        t = torch.from_numpy(arr[r0:r1]) if arr.flags.writeable else _t(arr[r0:r1])
        self.io.read += t.numel() * 4
        return t

    def _input(self, i: int, h: Input, r0: int, r1: int) -> Tensor:
        """Layer ``i``'s input rows ``[r0, r1)``: read from ``h``, or the dropped-out features recomputed."""
        if isinstance(h, MappedSparseRows):
            s = h.rows(r0, r1)
            self.io.read += h.rows_nbytes(r0, r1)
            if self._drop0 is None:
                return s
            p, seed = self._drop0  # the whole matrix's mask at each stored value's (row, column)
            return hash_dropout.apply_sparse(s, p, cast(int, self._seed_at(seed, r0, s)))
        if i > 0 or self._drop0 is None:
            return self._read(h, r0, r1)
        p, seed = self._drop0
        t = _t(h[r0:r1])
        self.io.read += t.numel() * 4
        hash_dropout.apply_(t, p, seed=self._seed_at(seed, r0, t))
        return t

    def _write(self, arr: np.ndarray, r0: int, r1: int, t: Tensor) -> None:
        arr[r0:r1] = t.detach().numpy()
        self.io.written += t.numel() * 4

    def _aggregate(self, kind: str, r0: int, r1: int, src: np.ndarray, reverse: bool = False) -> Tensor:
        tile = self.graph.tile(r0, r1, reverse=reverse)
        self.io.gathered += tile.num_edges * src.shape[1] * 4
        return self.graph.aggregate(kind, tile, src, reverse=reverse)

    # ---- the dense part of a layer -------------------------------------------------------------------
    def _dense(self, i: int, a: Tensor, h: Tensor | None, z: Tensor | None, *, aggregate_first: bool,
               p: float, seed: int | None, r0: int) -> Tensor:
        """Layer ``i``'s output rows from its aggregation rows: epilogue, bias, ReLU and the next dropout."""
        conv = self.convs[i]
        n = a.shape[0]
        o = conv.epilogue(a, h if h is not None else a[:0], z, aggregate_first, n)
        bias = conv.output_bias()
        if i == len(self.convs) - 1:
            return o if bias is None else o + bias
        with self._keyed(r0, o.shape[0]):
            return bias_act_dropout(o, bias, act=True, p=p, training=p > 0.0, seed=self._seed_at(seed, r0, o))

    def _seed_at(self, seed: int | None, r0: int, t: Tensor) -> int | None:
        """The mask seed of a tile starting at row ``r0``: the whole tensor's part, by offset or by row keys."""
        if seed is None or self.halo is not None:  # a rank: the rows' global ids key the mask
            return seed
        return hash_dropout.tile_seed(seed, r0 * (t.numel() // max(1, t.shape[0])))

    def _keyed(self, r0: int, rows: int) -> AbstractContextManager[None]:
        if self.halo is None:
            return nullcontext()
        return hash_dropout.keyed_rows(nodes=self.halo.keys[r0:r0 + rows])

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, training: bool, rows: Gather) -> Tensor:
        """Logits of the node ids of ``rows`` (see :meth:`_forward`); sparse input tiles leave no memoized graph."""
        with unmemoized():
            return self._forward(training, rows)

    def _forward(self, training: bool, rows: Gather) -> Tensor:
        """Logits of the node ids of ``rows``, in their order, after a forward pass over every tile (no autograd).

        In training every layer's aggregation and output are left in spill files for :meth:`backward`,
        and the dropout seeds are drawn from torch's generator in the in-memory run's order.
        """
        plan = self.plan(training)
        p = float(self.model.dropout) if training else 0.0
        L = len(self.convs)
        self._seeds: list[int | None] = []
        h: Input = self.x
        self._drop0 = None
        if p > 0.0 and self.halo is None and not plan.layers[0].order(0):
            # Transform first: every read of the dropped-out features is a tile's rows, so they are recomputed
            # per tile from the features and the counter-based mask (the same values as a spill, bit for bit)
            # instead of written and read back: N x F bytes less to write, to read and to hold on disk.
            self._drop0 = (p, hash_dropout.draw_seed())
        elif p > 0.0:
            x = self.x
            assert isinstance(x, np.ndarray), "sparse input rows are transformed first (stats.sparse_input)"
            seed = hash_dropout.draw_seed()
            h0 = self.spill.array("h0", x.shape)
            for r0, r1 in self._pass([x]):
                t = _t(x[r0:r1])
                with self._keyed(r0, r1 - r0):
                    hash_dropout.apply_(t, p, seed=self._seed_at(seed, r0, t))
                self._write(h0, r0, r1, t)
                del t  # a tile's tensors go before the next tile's are made: one tile at a time, as planned
            if self.halo is not None:
                self.halo.fill(h0)
            h = h0
        self._inputs = [h]
        out = torch.empty((len(rows), self.out_widths[-1]))  # written in place: no per-tile list, no concat
        fused: np.ndarray | None = None  # this layer's transformed rows, made by the previous layer's pass
        with torch.no_grad():
            for i, conv in enumerate(self.convs):
                lp = plan.layers[i]
                af, cached, last = lp.order(0), lp.is_cached(0), i == L - 1
                seed_i = hash_dropout.draw_seed() if (p > 0.0 and not last) else None
                self._seeds.append(seed_i)
                z = fused
                if not af and z is None:
                    w = conv.transform_weight()
                    z = self.spill.array(f"z{i}", (h.shape[0], w.shape[0]))
                    for r0, r1 in self._pass([h]):
                        self._write(z, r0, r1, linear(self._input(i, h, r0, r1), w))
                if not af and self.halo is not None:
                    assert z is not None
                    self.halo.fill(z, i)
                src = h if af else z
                assert isinstance(src, np.ndarray), "sparse input rows are transformed first (stats.sparse_input)"
                name = "a0c" if cached else f"a{i}"
                fresh = not (cached and self.spill.has(name))
                a = self.spill.array(name, (h.shape[0], src.shape[1]))
                nxt = None if last else self.spill.array(f"h{i + 1}", (h.shape[0], self.out_widths[i]))
                # Evaluating, a next layer that transforms first and never reads its input rows gets its
                # transformed rows from this pass: the layer's output is neither written nor read back.
                w_next, fused = None, None
                if nxt is not None and not (training or self.keep_outputs) and not plan.layers[i + 1].order(0) \
                        and not self._reads(i + 1, False)[0]:
                    w_next = self.convs[i + 1].transform_weight()
                    fused = self.spill.array(f"z{i + 1}", (h.shape[0], w_next.shape[0]))
                uses_h, uses_z = self._reads(i, af)
                # read ahead only what the pass reads by tile (not a spill it writes, nor an input it skips)
                for r0, r1 in self._pass([None if fresh else a, h if uses_h else None, z if uses_z else None]):
                    if fresh:
                        a_t = self._aggregate(self.kinds[i], r0, r1, src)
                        self._write(a, r0, r1, a_t)
                    else:
                        a_t = self._read(a, r0, r1)
                    h_t = self._input(i, h, r0, r1) if uses_h else None
                    z_t = self._read(z, r0, r1) if (z is not None and uses_z) else None
                    y = self._dense(i, a_t, h_t, z_t, aggregate_first=af, p=p, seed=seed_i, r0=r0)
                    if fused is not None:
                        assert w_next is not None
                        self._write(fused, r0, r1, F.linear(y, w_next))
                    elif nxt is not None:
                        self._write(nxt, r0, r1, y)
                    else:
                        lo, hi = np.searchsorted(rows.ids, [r0, r1])
                        if hi > lo:
                            local = torch.from_numpy(rows.ids[lo:hi] - r0)
                            out.index_copy_(0, rows.dest[lo:hi], y.index_select(0, local))
                    del a_t, h_t, z_t, y
                if nxt is not None:
                    if self.halo is not None and plan.layers[i + 1].order(0):  # the next layer reads its halo
                        self.halo.fill(nxt, i + 1)
                    h = nxt
                    self._inputs.append(h)
        return out

    # ---- backward ------------------------------------------------------------------------------------
    def backward(self, rows: Gather, grad_rows: Tensor) -> None:
        """Parameter gradients from the logits' loss gradient (see :meth:`_backward`), leaving no memoized graph."""
        with unmemoized():
            self._backward(rows, grad_rows)

    def _backward(self, rows: Gather, grad_rows: Tensor) -> None:
        """Accumulate parameter gradients given the loss gradient of the logits of ``rows`` (in their order).

        Must follow a training :meth:`forward` (it reads that pass's spills and dropout seeds).
        """
        plan = self.plan(True)
        p = float(self.model.dropout)
        L = len(self.convs)
        n = self.graph.num_nodes
        g_out = self.spill.array(f"g{L}", (n, self.out_widths[-1]))
        g_out[:] = 0.0
        rows.scatter_into(g_out, grad_rows)
        self.io.written += grad_rows.numel() * 4
        for i in reversed(range(L)):
            lp = plan.layers[i]
            af, cached = lp.order(0), lp.is_cached(0)
            h = self._inputs[i]
            a = self.spill.get("a0c" if cached else f"a{i}")
            z = self.spill.get(f"z{i}") if not af else None
            need_in = i > 0  # the features need no gradient
            need_a = need_in or not af  # transform first: the weight's gradient runs through the aggregation
            uses_h, uses_z = self._reads(i, af)
            # Gradient spills keep their files from epoch to epoch: rewriting mapped pages costs no faults.
            ga = self.spill.array(f"ga{i}", a.shape) if need_a else None
            gh_root = self.spill.array(f"gh_root{i}", h.shape) if (uses_h and need_in) else None
            gz_root = self.spill.array(f"gz_root{i}", (n, self.decls[i].out_dim)) if uses_z else None
            for r0, r1 in self._pass([a, h, z, g_out]):
                a_t = self._read(a, r0, r1).requires_grad_(need_a)
                h_t = self._input(i, h, r0, r1).requires_grad_(need_in) if uses_h else None
                z_t = self._read(z, r0, r1).requires_grad_(True) if (uses_z and z is not None) else None
                with torch.enable_grad():
                    y = self._dense(i, a_t, h_t, z_t, aggregate_first=af, p=p, seed=self._seeds[i], r0=r0)
                    y.backward(self._read(g_out, r0, r1))
                if ga is not None:
                    self._write(ga, r0, r1, _grad(a_t))
                if gh_root is not None:
                    self._write(gh_root, r0, r1, _grad(h_t))
                if gz_root is not None:
                    self._write(gz_root, r0, r1, _grad(z_t))
                del a_t, h_t, z_t, y
            if ga is None:
                continue
            g_in = self.spill.array(f"g{i}", h.shape) if need_in else None
            w = self.convs[i].transform_weight()
            g_src = None
            if self.halo is not None:  # the sources' gradients, halo rows' added at their owners first
                g_src = self.spill.array(f"gs{i}", (self.graph.num_src, ga.shape[1]))
                for r0, r1 in self._pass([], self.source_bounds):
                    self._write(g_src, r0, r1, self._aggregate(self.kinds[i], r0, r1, ga, reverse=True))
                self.halo.add_back(g_src, i)
            for r0, r1 in self._pass([h, gh_root, gz_root]):
                gs = self._aggregate(self.kinds[i], r0, r1, ga, reverse=True) if g_src is None else \
                    self._read(g_src, r0, r1)
                gh: Tensor | None = gs
                if not af:
                    gz = gs if gz_root is None else gs + self._read(gz_root, r0, r1)
                    h_t = self._input(i, h, r0, r1).requires_grad_(need_in)
                    with torch.enable_grad():
                        linear(h_t, w).backward(gz)
                    gh = h_t.grad
                    del gz, h_t
                if g_in is not None:
                    assert gh is not None
                    if gh_root is not None:
                        gh = gh + self._read(gh_root, r0, r1)
                    self._write(g_in, r0, r1, gh)
                del gs, gh
            g_out = g_in if g_in is not None else g_out


def epoch_traffic(model: nn.Module, stats: GraphStats, train_rows: int, input_bytes: int | None = None) -> EpochIO:
    """The spill bytes one epoch of :class:`TiledGNN` writes and reads (training step and evaluation), by rule.

    An epoch after the first, one process: the normalized features' spill and a cached first aggregation are
    written once, in the first epoch, and not counted here. This mirrors :meth:`TiledGNN.forward` and
    :meth:`TiledGNN.backward` pass by pass (a test holds it to the engine's own counters). Why not the memory
    plan's rule of thumb: it left out every read of the features (a transform-first layer reads its input in
    forward, backward and evaluation) and counted a cached aggregation as written every epoch; ``--explain``
    printed 2 MiB of reads for an epoch that read 45 MiB. ``input_bytes``: what one read of the whole input
    costs when it is not ``N x F`` float32 (sparse rows, :class:`~trellis.ops.sparse_rows.MappedSparseRows`).
    """
    check_tileable(model)
    gnn = cast(GNN, model)
    decls = [cast(PushdownConv, c).declare() for c in gnn.convs]
    outs = [output_width(c) for c in gnn.convs]  # decl.out_dim: the transformed rows' width
    n, L, p = stats.num_dst, len(decls), float(gnn.dropout)
    io = EpochIO()

    def reads(i: int, af: bool) -> tuple[bool, bool]:
        return root_reads(decls[i].root, af)

    def rows_in(i: int) -> int:  # bytes of one read of layer i's whole input
        return input_bytes if (i == 0 and input_bytes is not None) else n * decls[i].in_dim * 4

    plans = {t: plan_model([model_decl(model)], stats, training=t, input_grad=False) for t in (True, False)}
    for training in (True, False):
        plan, drop = plans[training], (p if training else 0.0)
        if drop > 0.0 and plan.layers[0].order(0):  # aggregate first: the dropped-out features are spilled
            io.written += n * decls[0].in_dim * 4
        fused = False
        for i, d in enumerate(decls):
            af, last = plan.layers[i].order(0), i == L - 1
            if not af and not fused:  # the transformed input: the layer input read, z written
                io.read += rows_in(i)
                io.written += n * d.out_dim * 4
            agg = (d.in_dim if af else d.out_dim) * n * 4
            if plan.layers[i].is_cached(0):
                io.read += agg  # the cached aggregation of the constant input (written in the first epoch)
            else:
                io.written += agg
            fuse_next = (not last and not training and not plans[False].layers[i + 1].order(0)
                         and not reads(i + 1, False)[0])
            uses_h, uses_z = reads(i, af)
            io.read += (rows_in(i) if uses_h else 0) + n * 4 * (d.out_dim if uses_z else 0)
            if fuse_next:
                io.written += n * decls[i + 1].out_dim * 4
            elif not last:
                io.written += n * outs[i] * 4
            fused = fuse_next
    plan = plans[True]
    io.written += train_rows * outs[-1] * 4  # the logits' loss gradient
    for i in reversed(range(L)):
        d, af = decls[i], plan.layers[i].order(0)
        agg = (d.in_dim if af else d.out_dim) * n * 4
        need_in = i > 0
        need_a = need_in or not af
        uses_h, uses_z = reads(i, af)
        io.read += agg + (rows_in(i) if uses_h else 0) + n * 4 * ((d.out_dim if uses_z else 0) + outs[i])
        io.written += (agg if need_a else 0) + n * 4 * ((d.in_dim if uses_h and need_in else 0)
                                                        + (d.out_dim if uses_z else 0))
        if not need_a:
            continue
        if not af:
            io.read += n * 4 * (d.out_dim if uses_z else 0) + rows_in(i)
        if need_in:
            io.read += n * 4 * (d.in_dim if uses_h else 0)
            io.written += n * 4 * d.in_dim
    return io


def _grad(t: Tensor | None) -> Tensor:
    assert t is not None
    return t.grad if t.grad is not None else torch.zeros_like(t)


@dataclass(frozen=True)
class Gather:
    """Node ids whose output rows a pass keeps, in the caller's order (ids may repeat).

    Tiles find their ids by binary search in ``ids`` (sorted); ``dest`` says where each sorted id's row goes
    in the output, so the output is in the caller's order without a second copy.
    """

    ids: np.ndarray
    dest: Tensor

    @classmethod
    def of(cls, ids: np.ndarray) -> Gather:
        """The gather of ``ids`` (any order, repeats allowed)."""
        order = np.argsort(ids, kind="stable")
        return cls(np.ascontiguousarray(ids[order], dtype=np.int64), torch.from_numpy(order.astype(np.int64)))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held (ids and destinations)."""
        return int(self.ids.nbytes + self.dest.numel() * 8)

    def scatter_into(self, out: np.ndarray, rows: Tensor) -> None:
        """``out[id] += rows[k]`` for each ``k``-th id of the caller's order, into a zeroed ``out``.

        A repeated id's rows add up (a node listed twice in a split counts twice in the loss, as in memory);
        without repeats this is one assignment.
        """
        vals = rows.index_select(0, self.dest).numpy()
        if self.ids.shape[0] > 1 and bool((self.ids[1:] == self.ids[:-1]).any()):
            np.add.at(out, self.ids, vals)
        else:
            out[self.ids] = vals
