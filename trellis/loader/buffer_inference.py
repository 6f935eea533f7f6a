"""Layer-wise inference over a partition buffer: evaluation and prediction within the training budget.

Why: exact layer-wise inference (:mod:`trellis.loader.inference`) holds one ``[N, width]`` matrix per layer
and reads a node's in-neighbours' rows at random; on a graph beyond memory neither fits. Here every layer is
one pass over the parts with the buffer's residency: K parts resident plus the cache, parts read whole and
sequentially, each part's outputs computed once (when it enters the buffer) over its in-edges whose sources
are available, and written sequentially to a per-part spill file that the next layer reads as its input
rows. The cache's rows are carried from layer to layer (a cached node's output is kept when its part is
computed). With every part resident this is exact layer-wise inference; with fewer, neighbours outside the
buffer and the cache are left out, as in training.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.loader.blocks import attach_edge_data
from trellis.loader.buffer import PartitionBuffer, PartRows, buffer_states, read_npy, state_graph
from trellis.loader.features import gather_rows, normalize_rows_
from trellis.loader.sampler import NeighborSampler
from trellis.utils.diskmap import new_map

#: Edges per chunk of destination rows (bounds a chunk's gathered rows and per-edge work).
CHUNK_EDGES = 2_000_000
#: Bytes per in-edge of a chunk besides its source row: the sampled block's indices and edge ids, the SpMM's.
EDGE_BYTES = 48
#: Float32 copies of a destination row's output a layer holds at its peak (aggregation, transform, epilogue).
OUT_COPIES = 4


def chunk_cuts(deg: np.ndarray, width_in: int, width_out: int, chunk_bytes: int | None) -> np.ndarray:
    """Boundaries of the chunks of destination rows with in-degrees ``deg``.

    Each chunk has at most :data:`CHUNK_EDGES` edges and at most ``chunk_bytes`` of working memory (None: edges
    only), but one row at least. A chunk holds one gathered source row per in-edge at most, its edges' indices and
    its rows' outputs; on a graph of a few hundred thousand nodes a 2M-edge chunk was a whole part, whose rows and
    activations (100 MiB at hidden 256) no budget counted.
    """
    edges = np.cumsum(deg + 1)
    cuts = [np.searchsorted(edges, np.arange(CHUNK_EDGES, int(edges[-1]) + CHUNK_EDGES, CHUNK_EDGES))]
    if chunk_bytes is not None:
        cost = np.cumsum((deg + 1) * (width_in * 4 + EDGE_BYTES) + width_out * 4 * OUT_COPIES)
        cuts.append(np.searchsorted(cost, np.arange(chunk_bytes, int(cost[-1]) + chunk_bytes, chunk_bytes)))
    n = deg.shape[0]
    return np.unique(np.concatenate([[0], *(np.minimum(c + 1, n) for c in cuts), [n]]))


def _write_rows(path: Path, rows: int, width: int) -> tuple[object, Callable[[np.ndarray], None]]:
    """An ``.npy`` file of ``[rows, width]`` float32 written front to back by the returned appender."""
    f = open(path, "wb")  # noqa: SIM115 - closed by _finish
    header = {"descr": "<f4", "fortran_order": False, "shape": (rows, width)}
    np.lib.format.write_array_header_1_0(f, header)

    def append(block: np.ndarray) -> None:
        f.write(np.ascontiguousarray(block, dtype=np.float32).tobytes())

    return f, append


def _finish(f: object) -> None:
    f.flush()  # type: ignore[attr-defined]
    os.fdatasync(f.fileno())  # type: ignore[attr-defined]
    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # type: ignore[attr-defined]
    f.close()  # type: ignore[attr-defined]


def _rows_file(layout: Path, spill: Path, layer: int) -> Callable[[int], Path]:
    """Where part ``q``'s input rows of ``layer`` are: the layout's features, then the previous layer's spill."""
    if layer == 0:
        return lambda q: layout / f"part-{q:05d}" / "x.npy"
    return lambda q: spill / f"h{layer}-{q:05d}.npy"


class _LayerPass:
    """One layer's pass over the parts: an arena of part slots and the node -> row map (the cache after them)."""

    def __init__(self, buf: PartitionBuffer, arena: np.ndarray, rows_file: Callable[[int], Path], *,
                 normalize: bool) -> None:
        self.buf, self.arena, self.rows_file, self.normalize = buf, arena, rows_file, normalize
        self.slot_of = np.full(buf.num_nodes, -1, dtype=np.int64)
        self.cache_base = arena.shape[0]
        cached = np.flatnonzero(buf.cached)
        self.slot_of[cached] = self.cache_base + np.arange(cached.shape[0])
        self.free = list(range(min(buf.capacity + 1, buf.num_parts)))
        self.resident: dict[int, tuple[int, PartRows]] = {}

    def load(self, q: int) -> tuple[int, PartRows]:
        """Read part ``q``'s input rows into a free slot, and its in-edges."""
        buf = self.buf
        s = self.free.pop()
        nl = int(buf.part_rows[q])
        block = self.arena[s * buf.max_rows: s * buf.max_rows + nl]
        read_npy(self.rows_file(q), block)
        if self.normalize:
            normalize_rows_(block, buf.feature_norm)
        return s, buf.read_edges(q)

    def activate(self, q: int, got: tuple[int, PartRows]) -> None:
        """Point part ``q``'s uncached nodes at their slot rows."""
        s, piece = got
        keep = ~self.buf.cached[piece.rows]
        self.slot_of[piece.rows[keep]] = s * self.buf.max_rows + np.flatnonzero(keep)
        self.resident[q] = got

    def evict(self, q: int) -> None:
        """Free part ``q``'s slot."""
        s, piece = self.resident.pop(q)
        self.slot_of[piece.rows[~self.buf.cached[piece.rows]]] = -1
        self.free.append(s)


def check_buffer_inference(model: nn.Module) -> None:
    """Refuse what layer-wise inference over the buffer cannot evaluate, before a run trains.

    Raises:
        TrellisUserError: ``--jk`` (every layer's output of a node at once) or ``--pre-norm`` (an input layer
            over the feature rows before the first graph layer).
    """
    if getattr(model, "jk", "none") != "none":
        raise TrellisUserError("--jk needs every layer's output of a node at once; buffer inference writes one "
                               "layer at a time (drop --jk, or evaluate without --memory-budget)")
    if getattr(model, "pre_norm", False):
        raise TrellisUserError("--pre-norm puts an input layer before the first graph layer, which buffer inference "
                               "does not run (drop --pre-norm, or train without --memory-budget)")


class _EmbeddingFile:
    """The last layer's input rows of every node, written part by part as the last pass reads them.

    Why there: the last pass loads every part's input rows (the penultimate layer's outputs, or the features of a
    one-layer model) whole into its slot, which is what ``trellis predict`` writes as the embeddings; copying
    them out then costs one write per part and no extra read. The file is made under a temporary name and
    renamed when complete, so no half-written ``.npy`` remains.
    """

    def __init__(self, path: Path, rows: int, width: int) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp.npy")
        self.map = new_map(self.tmp, (rows, width), np.float32, "free space or write the embeddings elsewhere")

    def write(self, rows: np.ndarray, block: np.ndarray) -> None:
        self.map[rows] = block

    def finish(self) -> int:
        """Flush, rename into place; returns the embedding width."""
        width = int(self.map.shape[1])
        self.map.flush()
        del self.map
        os.replace(self.tmp, self.path)
        return width

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


@torch.no_grad()
def buffer_inference(model: nn.Module, buf: PartitionBuffer, spill: Path, *, rows: np.ndarray | None = None,
                     device: torch.device | str = "cpu", chunk_bytes: int | None = None,
                     embeddings_to: Path | None = None,
                     first_input: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Outputs of ``model`` for ``rows`` (sorted, unique; None = every node), layer by layer over the buffer.

    Args:
        model: A layer stack with ``convs`` and ``activation`` (:class:`trellis.nn.models.GNN`).
        buf: The training buffer (its resident parts are evicted: the next epoch reads them again).
        spill: Directory for the per-part layer outputs (removed by the caller).
        rows: Nodes whose final outputs are returned (sorted ascending, unique).
        device: Where the layers run.
        chunk_bytes: Working memory of one chunk of destination rows (a budget's share: see :func:`chunk_cuts`).
        embeddings_to: Where to write every node's last-layer input as a ``[N, width]`` ``.npy`` (None: nowhere).
        first_input: Applied to the first layer's input rows (see
            :func:`~trellis.loader.inference.layerwise_inference`).
    """
    convs: list[nn.Module] = list(model.convs)  # type: ignore[arg-type]
    check_buffer_inference(model)
    post: Callable[[int, Tensor, Tensor], Tensor] = model.post  # type: ignore[assignment]
    dev = torch.device(device)
    was_training = model.training
    model.eval()
    buf.release()
    n, p = buf.num_nodes, buf.num_parts
    wanted = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    cached = np.flatnonzero(buf.cached)
    cache_in: np.ndarray = buf.arena[buf.cache_base:]  # layer 0: the cached feature rows
    out: Tensor | None = None
    sampler = NeighborSampler(np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), [-1], degrees=buf.degree)
    order = buffer_states(p, buf.capacity, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                          np.random.default_rng(0))
    emb: _EmbeddingFile | None = None
    try:
        for li, conv in enumerate(convs):
            last = li == len(convs) - 1
            width_in = int(cache_in.shape[1]) if cache_in.ndim == 2 and cache_in.shape[0] else None
            rows_file = _rows_file(buf.path, spill, li)
            if width_in is None:
                width_in = buf.dim if li == 0 else int(np.load(rows_file(0), mmap_mode="r").shape[1])
            slots = min(buf.capacity + 1, p)
            need = slots * buf.max_rows * width_in
            flat = buf.arena.reshape(-1)[: buf.cache_base * buf.dim]
            arena = (flat[:need] if need <= flat.shape[0] else np.empty(need, np.float32)).reshape(-1, width_in)
            lp = _LayerPass(buf, arena, rows_file, normalize=li == 0)
            if last and embeddings_to is not None:
                emb = _EmbeddingFile(embeddings_to, n, width_in)
            slot_of, c_base = lp.slot_of, lp.cache_base
            cache_out: np.ndarray | None = None
            load, activate, evict, resident = lp.load, lp.activate, lp.evict, lp.resident

            states = order
            todo: list[list[int]] = [list(states[0].parts)] + [[s.enters] for s in states[1:]]  # type: ignore[list-item]
            for q in states[0].parts:
                activate(q, load(q))
            for k, state in enumerate(states):
                if k > 0:
                    assert state.leaves is not None and state.enters is not None
                    evict(state.leaves)
                    activate(state.enters, load(state.enters))
                part_on = np.zeros(p, dtype=bool)
                part_on[list(state.parts)] = True
                in_parts = part_on[buf.node_part]
                avail = in_parts | buf.cached
                for q in todo[k]:
                    piece = resident[q][1]
                    if last and emb is not None:
                        at = resident[q][0] * buf.max_rows
                        emb.write(piece.rows, arena[at: at + piece.rows.shape[0]])
                    ip, ix, eids, _, _ = state_graph(n, [piece], avail, in_parts)
                    g = sampler.with_graph(ip, ix)
                    nodes = piece.rows
                    dst = nodes if not last else nodes[np.isin(nodes, wanted, assume_unique=True)]
                    if last and dst.size == 0:
                        continue
                    f = None
                    cuts = chunk_cuts(np.diff(ip)[dst], width_in, int(getattr(conv, "out_dim", width_in)), chunk_bytes)
                    for a, b in zip(cuts[:-1], cuts[1:]):
                        batch = g.sample(dst[a:b], 0)
                        block = batch.blocks[0]
                        if buf.edge_weight is not None or buf.edge_feat is not None:
                            assert block.edge_ids is not None
                            block.edge_ids = torch.from_numpy(eids[block.edge_ids.numpy()])
                            attach_edge_data([block], buf.edge_weight, buf.edge_feat)
                        ids = batch.node_ids.numpy()
                        where = slot_of[ids]
                        h_in = np.empty((ids.shape[0], width_in), dtype=np.float32)
                        from_cache = where >= c_base
                        gather_rows(arena, np.where(from_cache, 0, where), h_in)
                        if from_cache.any():
                            h_in[from_cache] = cache_in[where[from_cache] - c_base]
                        x_in = torch.from_numpy(h_in).to(dev)
                        if li == 0 and first_input is not None:
                            x_in = first_input(x_in)
                        y = post(li, x_in, conv(block.to(dev), x_in))
                        if last:
                            if out is None:
                                out = torch.empty((wanted.shape[0], *y.shape[1:]), dtype=y.dtype, device=dev)
                            out[torch.from_numpy(np.searchsorted(wanted, dst[a:b])).to(dev)] = y
                            continue
                        y_np = y.float().cpu().numpy()
                        if f is None:
                            f, append = _write_rows(spill / f"h{li + 1}-{q:05d}.npy", nodes.shape[0], y_np.shape[1])
                        append(y_np)
                        if cached.size:
                            if cache_out is None:
                                cache_out = np.zeros((cached.shape[0], y_np.shape[1]), dtype=np.float32)
                            chunk = dst[a:b]
                            mine = buf.cached[chunk]
                            cache_out[np.searchsorted(cached, chunk[mine])] = y_np[mine]
                    if f is not None:
                        _finish(f)
            cache_in = cache_out if cache_out is not None else np.zeros((0, 0), dtype=np.float32)
            for q in list(resident):
                evict(q)
        assert out is not None
        if emb is not None:
            emb.finish()
            emb = None
        return out
    finally:
        if emb is not None:
            emb.discard()
        model.train(was_training)


__all__ = ["buffer_inference", "chunk_cuts"]
