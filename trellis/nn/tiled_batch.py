"""K configurations out of core together: every tile's graph reads and aggregations shared (Lotan's batching).

Why: out of core, an epoch is mostly the tiled aggregations — reading each tile's CSR rows and gathering its
source rows from the spills — and the dense work beside them is small. K configurations of one family and
depth trained one after another repeat every one of those reads K times. Here the K configurations'
aggregation inputs sit side by side in one wide spill (each configuration's column block holds its layer
input when it aggregates first, its transformed rows when it transforms first), so one kernel call per tile
aggregates all of them — the CSR tile is read once and each gathered source row is one contiguous read of
K blocks — and the backward's transposed aggregation is shared the same way. The features are read once
per pass for every configuration's dropout, and configurations that aggregate the undropped features
first share one cached ``ÂX``.

Exactness: each configuration's dense work is its own :class:`~trellis.nn.tiled.TiledGNN`'s (same layers,
same plan order, same epilogue), its dropout seeds are drawn from its own generator in its solo run's
order, and the aggregation kernel sums each column over the same edges in the same order whatever the
width. So each configuration computes what its solo out-of-core run computes; only the tile boundaries
(planned for K) move the last bits of the weight gradients, as any change of budget does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.nn.runtime import generator_scope
from trellis.nn.tiled import EpochIO, Gather, Input, TiledGNN, _grad
from trellis.ops import dropout as hash_dropout
from trellis.ops.sparse_rows import MappedSparseRows, linear, unmemoized
from trellis.ops.tiled import MappedCSR
from trellis.plan.cost import GraphStats
from trellis.utils.spill import SpillDir


@dataclass(frozen=True)
class Block:
    """Columns ``[c0, c1)`` of a spill array: one configuration's part of a wide tensor (or the whole array)."""

    arr: Input
    c0: int
    c1: int

    @classmethod
    def whole(cls, arr: Input) -> Block:
        """Every column of ``arr``."""
        return cls(arr, 0, int(arr.shape[1]))

    @property
    def width(self) -> int:
        """Columns."""
        return self.c1 - self.c0

    @property
    def dense(self) -> np.ndarray:
        """The array (a spill: dense rows, never the sparse input rows, which are read through ``_input``)."""
        assert isinstance(self.arr, np.ndarray)
        return self.arr


def _block(b: Block | None) -> Block:
    """A configuration's input block of a layer; None where evaluation fused it into the previous pass."""
    assert b is not None, "a fused layer's input rows are never written, so never read"
    return b


def _source_block(arr: np.ndarray | None, cols: tuple[int, int]) -> Block:
    """Columns ``cols`` of a layer's wide aggregation source (which exists where a configuration has columns)."""
    assert arr is not None
    return Block(arr, *cols)


class _TileWrites:
    """Blocks computed for one tile's rows, written per array: one contiguous write when they cover its columns.

    Strided writes of K narrow blocks into a wide spill cost several times one contiguous write of the rows.
    """

    def __init__(self, engine: BatchedTiledGNN) -> None:
        self.engine = engine
        self.parts: dict[int, tuple[np.ndarray, list[tuple[int, int, Tensor]]]] = {}

    def add(self, b: Block, t: Tensor) -> None:
        """Queue ``t`` for block ``b``."""
        self.parts.setdefault(id(b.arr), (b.dense, []))[1].append((b.c0, b.c1, t))

    def flush(self, r0: int, r1: int) -> None:
        """Write every queued block of rows ``[r0, r1)``."""
        for arr, parts in self.parts.values():
            parts.sort(key=lambda p: p[0])
            ends = [0] + [p[1] for p in parts]
            if [p[0] for p in parts] == ends[:-1] and ends[-1] == arr.shape[1] and len(parts) > 1:
                self.engine._write(Block.whole(arr), r0, r1, torch.cat([p[2] for p in parts], dim=1))
            else:
                for c0, c1, t in parts:
                    self.engine._write(Block(arr, c0, c1), r0, r1, t)
        self.parts.clear()


class BatchedTiledGNN:
    """Runs K batchable GNNs (GCN, SAGE mean, GIN) of one family and depth out of core in shared passes.

    Args:
        models: The configurations' models (parameters used in place).
        generators: Each configuration's dropout generator (None: the default generator).
        graph: The memory-mapped CSR and its reverse.
        x: The first layer's input ``[N, F]``.
        spill: Where the ``[N, d]`` tensors go.
        bounds: Row boundaries of the tiles (planned for all K).
        cold: Drop the page cache before every pass (see :class:`~trellis.nn.tiled.TiledGNN`).

    Raises:
        TrellisUserError: Models of different depths or aggregations.
    """

    def __init__(self, models: Sequence[nn.Module], generators: Sequence[torch.Generator | None],
                 graph: MappedCSR, x: Input, spill: SpillDir, bounds: np.ndarray, *, cold: bool = False,
                 stats: GraphStats | None = None) -> None:
        self.engines = [TiledGNN(m, graph, x, spill, bounds, cold=cold, stats=stats) for m in models]
        if len({tuple(e.kinds) for e in self.engines}) > 1:
            raise TrellisUserError("configurations whose layers aggregate differently cannot share out-of-core tiles")
        self.generators = list(generators)
        self.graph, self.x, self.spill, self.bounds = graph, x, spill, bounds
        self.kinds = self.engines[0].kinds
        self.depth = len(self.kinds)
        self.active = list(range(len(models)))
        self.io = EpochIO()
        self._masks0: dict[int, tuple[float, int | None]] = {}
        self._xtile: tuple[int, Tensor] | None = None
        self._dropped: tuple[tuple[float, int | None], Tensor] | None = None

    # ---- spill access ---------------------------------------------------------------------------------
    def _read(self, b: Block, r0: int, r1: int) -> Tensor:
        arr = b.dense
        rows = arr[r0:r1, b.c0:b.c1] if (b.c0, b.c1) != (0, arr.shape[1]) else arr[r0:r1]
        if arr.flags.writeable and rows.flags.c_contiguous:
            t = torch.from_numpy(rows)
        else:
            t = torch.from_numpy(np.array(rows, dtype=np.float32))
        self.io.read += t.numel() * 4
        return t

    def _write(self, b: Block, r0: int, r1: int, t: Tensor) -> None:
        b.dense[r0:r1, b.c0:b.c1] = t.detach().numpy()
        self.io.written += t.numel() * 4

    def _input(self, j: int, i: int, b: Block, r0: int, r1: int) -> Tensor:
        """Configuration ``j``'s input rows of layer ``i``: read, or (its dropped-out features) recomputed.

        The feature tile is read once for every configuration that recomputes its mask on it (sparse rows: for
        every configuration), and the dropped-out tile is kept for the next configuration with the same rate and
        seed (a grid over learning rate or weight decay draws every configuration's mask from the same seed):
        callers only read it.
        """
        sparse = isinstance(b.arr, MappedSparseRows)
        if i > 0 or (j not in self._masks0 and not sparse):
            return self._read(b, r0, r1)
        if self._xtile is None or self._xtile[0] != r0:
            self._xtile = self._dropped = None  # the last tile's go first: one tile of features at a time
            self._xtile = (r0, self._features(r0, r1))
        x = self._xtile[1]
        if j not in self._masks0:
            return x
        p, seed = self._masks0[j]
        key = (p, self.engines[self.active[j]]._seed_at(seed, r0, x))
        if self._dropped is None or self._dropped[0] != key:  # equal rate and seed: the same mask, drawn once
            self._dropped = None
            if sparse:
                t = hash_dropout.apply_sparse(x, p, cast(int, key[1]))
            else:
                t = x.clone()
                hash_dropout.apply_(t, p, seed=key[1])
            self._dropped = (key, t)
        return self._dropped[1]

    def _features(self, r0: int, r1: int) -> Tensor:
        """Rows ``[r0, r1)`` of the features (a CSR tensor when they are sparse rows)."""
        if isinstance(self.x, MappedSparseRows):
            self.io.read += self.x.rows_nbytes(r0, r1)
            return self.x.rows(r0, r1)
        return self._read(Block.whole(self.x), r0, r1)

    def _aggregate(self, layer: int, r0: int, r1: int, src: np.ndarray, reverse: bool = False) -> Tensor:
        """Rows ``[r0, r1)`` of layer ``layer``'s aggregation of ``src`` (the transposed one with ``reverse``)."""
        tile = self.graph.tile(r0, r1, reverse=reverse)
        self.io.gathered += tile.num_edges * src.shape[1] * 4
        return self.graph.aggregate(self.kinds[layer], tile, src, reverse=reverse)

    def _wide(self, name: str, widths: dict[int, int]) -> tuple[np.ndarray | None, dict[int, tuple[int, int]]]:
        """A spill of the configurations' blocks side by side, and each one's columns."""
        cols, c = {}, 0
        for j, w in widths.items():
            cols[j] = (c, c + w)
            c += w
        return (self.spill.array(name, (self.graph.num_nodes, c)) if c else None), cols

    # ---- forward --------------------------------------------------------------------------------------
    def forward(self, training: bool, rows: Gather) -> list[Tensor]:
        """Each active configuration's logits of ``rows`` (see :meth:`_forward`), leaving no memoized graph."""
        with unmemoized():
            return self._forward(training, rows)

    def _forward(self, training: bool, rows: Gather) -> list[Tensor]:
        """Each active configuration's logits of ``rows`` (in their order), after one shared pass per layer.

        In training every layer's wide aggregation and each configuration's inputs are left in spills for
        :meth:`backward`, and each configuration's dropout seeds are drawn from its generator.
        """
        act = self.active
        E = [self.engines[k] for k in act]
        plans = [e.plan(training).layers for e in E]
        ps = [float(e.model.dropout) if training else 0.0 for e in E]
        L, n = self.depth, self.graph.num_nodes
        # Each configuration's seeds in its solo run's order: the input's, then one per hidden layer.
        seeds: list[list[int | None]] = []
        for p, k in zip(ps, act):
            with generator_scope(self.generators[k]):
                first = hash_dropout.draw_seed() if p > 0.0 else None
                seeds.append([first] + [hash_dropout.draw_seed() if (p > 0.0 and i < L - 1) else None
                                        for i in range(L)])
        # Layouts: at layer i, configuration j's aggregation source is a block of the wide s{i} (its input when
        # it aggregates first, its transformed rows otherwise); a cached first aggregation is shared instead.
        af = [[plans[j][i].order(0) for j in range(len(E))] for i in range(L)]
        cached = [plans[j][0].is_cached(0) for j in range(len(E))]
        # Configurations that aggregate the features first with the same dropout rate and seed (a grid over
        # learning rates or weight decay: equal seeds draw equal masks) share one block, aggregated once.
        first_of: dict[tuple[float, int | None], int] = {}
        rep = {j: first_of.setdefault((ps[j], seeds[j][0]), j) if af[0][j] else j for j in range(len(E))}
        srcs: list[np.ndarray | None] = []
        cols: list[dict[int, tuple[int, int]]] = []
        for i in range(L):
            widths = {j: (e.decls[i].in_dim if af[i][j] else int(e.convs[i].transform_weight().shape[0]))
                      for j, e in enumerate(E) if not (i == 0 and (cached[j] or rep[j] != j))}
            s, c = self._wide(f"s{i}", widths)
            if i == 0:
                c.update({j: c[rep[j]] for j in range(len(E)) if rep[j] != j and not cached[j]})
            srcs.append(s)
            cols.append(c)

        def input_block(i: int, j: int) -> Block:
            """Where configuration j's input of layer i > 0 is written: its source block, or its own spill."""
            if af[i][j]:
                s = srcs[i]
                assert s is not None
                return Block(s, *cols[i][j])
            return Block.whole(self.spill.array(f"m{act[j]}.h{i}", (n, E[j].decls[i].in_dim)))

        # Layer 0's inputs: the features, read once per tile for every configuration. A configuration that
        # transforms its dropped-out features first recomputes them per tile from its counter-based mask (nothing
        # spilled); one that aggregates them first needs them whole, in its source block.
        inputs: list[list[Block | None]] = [[Block.whole(self.x)] for _ in E]  # None: never read (fused)
        self._masks0 = {j: (ps[j], seeds[j][0]) for j, p in enumerate(ps) if p > 0.0 and not af[0][j]}
        self._xtile = self._dropped = None
        blocks0 = [j for j in range(len(E)) if af[0][j] and not cached[j]]
        for j in blocks0:
            inputs[j][0] = input_block(0, j)
        if blocks0:
            writes = _TileWrites(self)
            x = Block.whole(self.x).dense  # aggregated first: dense rows
            for r0, r1 in E[0]._pass([x]):
                t = torch.from_numpy(np.array(x[r0:r1], dtype=np.float32))
                for j in blocks0:
                    if rep[j] != j:
                        continue
                    tj = t.clone()
                    if ps[j] > 0.0:
                        hash_dropout.apply_(tj, ps[j], seed=E[j]._seed_at(seeds[j][0], r0, tj))
                    writes.add(_block(inputs[j][0]), tj)
                writes.flush(r0, r1)
                del t  # a tile's tensors go before the next tile's are made (the plan holds one tile)
        outs = [torch.empty((len(rows), e.out_widths[-1])) for e in E]
        self._saved = (act, af, cached, srcs, cols, inputs, seeds, ps)
        fused: set[int] = set()  # configurations whose layer-i transformed rows the previous pass wrote
        with torch.no_grad():
            for i in range(L):
                last = i == L - 1
                src = srcs[i]
                tf = [j for j in range(len(E)) if not af[i][j] and j not in fused]
                if tf:  # transformed rows of every transform-first configuration, before any tile aggregates
                    assert src is not None
                    writes = _TileWrites(self)
                    for r0, r1 in E[0]._pass([]):
                        for j in tf:
                            z = linear(self._input(j, i, _block(inputs[j][i]), r0, r1),
                                         E[j].convs[i].transform_weight())
                            writes.add(Block(src, *cols[i][j]), z)
                        writes.flush(r0, r1)
                a = self.spill.array(f"a{i}", src.shape) if src is not None else None
                shared = [j for j in range(len(E)) if i == 0 and cached[j]]
                a0c, fresh0 = None, False
                if shared:  # computed once, reused every epoch (as a solo run's cached first aggregation)
                    fresh0 = not self.spill.has("a0c")
                    a0c = self.spill.array("a0c", (n, self.x.shape[1]))
                # Evaluating, a next layer that transforms first and never reads its input rows gets its transformed
                # rows from this pass (as a solo run's): the layer's output is neither written nor read back.
                fused = set() if (training or last) else \
                    {j for j in range(len(E)) if not af[i + 1][j] and not E[j]._reads(i + 1, False)[0]}
                w_next = {j: E[j].convs[i + 1].transform_weight() for j in fused}
                nxt = {j: _source_block(srcs[i + 1], cols[i + 1][j]) if j in fused else input_block(i + 1, j)
                       for j in range(len(E))} if not last else {}
                writes = _TileWrites(self)
                for r0, r1 in E[0]._pass([a, self.x] if a is not None else [self.x]):
                    a_t = None
                    if src is not None and a is not None:
                        a_t = self._aggregate(i, r0, r1, src)
                        self._write(Block.whole(a), r0, r1, a_t)
                    c_t = None
                    if shared and a0c is not None:
                        if fresh0:
                            c_t = self._aggregate(0, r0, r1, Block.whole(self.x).dense)
                            self._write(Block.whole(a0c), r0, r1, c_t)
                        else:
                            c_t = self._read(Block.whole(a0c), r0, r1)
                    for j, e in enumerate(E):
                        if i == 0 and cached[j]:
                            assert c_t is not None
                            a_j = c_t
                        else:
                            assert a_t is not None
                            a_j = a_t[:, cols[i][j][0]:cols[i][j][1]]
                        uses_h, uses_z = e._reads(i, af[i][j])
                        h_t = self._input(j, i, _block(inputs[j][i]), r0, r1) if uses_h else None
                        z_t = self._read(Block(src, *cols[i][j]), r0, r1) if (uses_z and src is not None) else None
                        y = e._dense(i, a_j, h_t, z_t, aggregate_first=af[i][j], p=ps[j], seed=seeds[j][i + 1],
                                     r0=r0)
                        if j in fused:
                            writes.add(nxt[j], F.linear(y, w_next[j]))
                        elif not last:
                            writes.add(nxt[j], y)
                        else:
                            lo, hi = np.searchsorted(rows.ids, [r0, r1])
                            if hi > lo:
                                local = torch.from_numpy(rows.ids[lo:hi] - r0)
                                outs[j].index_copy_(0, rows.dest[lo:hi], y.index_select(0, local))
                        del a_j, h_t, z_t, y
                    writes.flush(r0, r1)
                    del a_t, c_t
                for j in nxt:
                    inputs[j].append(None if j in fused else nxt[j])
        return outs

    # ---- backward -------------------------------------------------------------------------------------
    def backward(self, rows: Gather, grads: Sequence[Tensor]) -> None:
        """Each active configuration's parameter gradients (see :meth:`_backward`), leaving no memoized graph."""
        with unmemoized():
            self._backward(rows, grads)

    def _backward(self, rows: Gather, grads: Sequence[Tensor]) -> None:
        """Accumulate each active configuration's parameter gradients given its logits' loss gradient.

        Must follow a training :meth:`forward` with the same active configurations.
        """
        act, af, cached, srcs, cols, inputs, seeds, ps = self._saved
        assert act == self.active, "backward after a forward of other configurations"
        ins = [[_block(b) for b in bs] for bs in inputs]  # a training forward fuses nothing
        E = [self.engines[k] for k in act]
        L, n = self.depth, self.graph.num_nodes
        g_out: list[Block] = []
        for j, e in enumerate(E):
            g = self.spill.array(f"m{act[j]}.g{L}", (n, e.out_widths[-1]))
            g[:] = 0.0
            rows.scatter_into(g, grads[j])
            self.io.written += grads[j].numel() * 4
            g_out.append(Block.whole(g))
        for i in reversed(range(L)):
            need_in = i > 0
            src = srcs[i]
            a = self.spill.get(f"a{i}") if src is not None else None
            # configurations whose aggregation needs a gradient: all but those aggregating the features first
            ga_js = [j for j in range(len(E)) if need_in or not af[i][j]]
            ga, ga_cols = self._wide(f"ga{i}", {j: cols[i][j][1] - cols[i][j][0] for j in ga_js})
            roots: dict[int, tuple[Block | None, Block | None]] = {}
            for j, e in enumerate(E):
                uses_h, uses_z = e._reads(i, af[i][j])
                gh_root = Block.whole(self.spill.array(f"m{act[j]}.gh_root{i}", (n, ins[j][i].width))) \
                    if (uses_h and need_in) else None
                gz_root = Block.whole(self.spill.array(f"m{act[j]}.gz_root{i}", (n, e.decls[i].out_dim))) \
                    if uses_z else None
                roots[j] = (gh_root, gz_root)
            writes = _TileWrites(self)
            for r0, r1 in E[0]._pass([arr for arr in (a, ga) if arr is not None]):
                a_t = self._read(Block.whole(a), r0, r1) if a is not None else None
                c_t = self._read(Block.whole(self.spill.get("a0c")), r0, r1) if (i == 0 and any(cached)) else None
                for j, e in enumerate(E):
                    need_a = j in ga_cols
                    uses_h, uses_z = e._reads(i, af[i][j])
                    if i == 0 and cached[j]:
                        assert c_t is not None
                        a_j = c_t.detach().requires_grad_(need_a)
                    else:
                        assert a_t is not None
                        a_j = a_t[:, cols[i][j][0]:cols[i][j][1]].detach().requires_grad_(need_a)
                    h_t = self._input(j, i, ins[j][i], r0, r1).detach().requires_grad_(need_in) if uses_h else None
                    z_t = self._read(Block(src, *cols[i][j]), r0, r1).detach().requires_grad_(True) \
                        if (uses_z and src is not None) else None
                    with torch.enable_grad():
                        y = e._dense(i, a_j, h_t, z_t, aggregate_first=af[i][j], p=ps[j], seed=seeds[j][i + 1],
                                     r0=r0)
                        y.backward(self._read(g_out[j], r0, r1))
                    if need_a and ga is not None:
                        writes.add(Block(ga, *ga_cols[j]), _grad(a_j))
                    gh_root, gz_root = roots[j]
                    if gh_root is not None:
                        self._write(gh_root, r0, r1, _grad(h_t))
                    if gz_root is not None:
                        self._write(gz_root, r0, r1, _grad(z_t))
                    del a_j, h_t, z_t, y
                writes.flush(r0, r1)
                del a_t, c_t
            if ga is None:
                continue
            g_in = {j: Block.whole(self.spill.array(f"m{act[j]}.g{i}", (n, ins[j][i].width)))
                    for j in ga_js} if need_in else {}
            for r0, r1 in E[0]._pass([ga]):
                gs_wide = self._aggregate(i, r0, r1, ga, reverse=True)
                for j in ga_js:
                    gs = gs_wide[:, ga_cols[j][0]:ga_cols[j][1]].contiguous()
                    gh_root, gz_root = roots[j]
                    gh: Tensor | None = gs
                    if not af[i][j]:
                        gz = gs if gz_root is None else gs + self._read(gz_root, r0, r1)
                        h_t = self._input(j, i, ins[j][i], r0, r1).detach().requires_grad_(need_in)
                        with torch.enable_grad():
                            linear(h_t, E[j].convs[i].transform_weight()).backward(gz)
                        gh = h_t.grad
                        del gz, h_t
                    if need_in:
                        assert gh is not None
                        if gh_root is not None:
                            gh = gh + self._read(gh_root, r0, r1)
                        self._write(g_in[j], r0, r1, gh)
                    del gs, gh
                del gs_wide
            g_out = [g_in.get(j, g_out[j]) for j in range(len(E))]
        self._xtile = self._dropped = None  # the last tile's features: not held between steps

    def drop(self, k: int) -> None:
        """Configuration ``k`` stopped."""
        if k in self.active:
            self.active.remove(k)
