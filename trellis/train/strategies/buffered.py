"""Mini-batch training through a partition buffer: ``--strategy mini --parts-dir PART_DIR --nproc 1``.

The run reads a partitioned layout (``trellis partition``) instead of the store's feature table: K of its P
parts are resident at a time (``--buffer-parts K``, or as many as ``--memory-budget`` holds), each read whole
and sequentially once per epoch, and batches are sampled from resident rows plus a cache of the rows most
likely to be sampled (:mod:`trellis.loader.buffer`). The store is opened for its labels, splits, degrees and
task only; its ``x.npy`` is never read, so a graph needs one copy of its features on disk.

With every part resident (``--buffer-parts P``, no cache) an epoch is one buffer state and its batches are
``--strategy mini``'s, bit for bit. Evaluation is exact layer-wise inference over the whole graph, with input
rows read from the layout's memory maps (it holds one ``[N, hidden]`` matrix per layer); under
``--memory-budget`` it runs layer-wise over the buffer instead (:mod:`trellis.loader.buffer_inference`),
within the budget, with the buffer's neighbourhoods (exact when every part is resident).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trellis.data.store import GraphStore, feature_norm_of
from trellis.errors import TrellisUserError
from trellis.loader.blocks import parse_fanouts
from trellis.loader.buffer import LayoutRows, PartitionBuffer, default_replay_fanouts
from trellis.loader.buffer_inference import buffer_inference, check_buffer_inference
from trellis.loader.features import NormalizedRows
from trellis.nn.layers import PUSHDOWN_LAYERS
from trellis.nn.models import input_aggregation
from trellis.partition.base import methods_of_ownership
from trellis.partition.layout import PartitionedGraph, open_layout_of, part_dir_name
from trellis.plan.residency import EVAL_CHUNK_BYTES, BufferCosts, BufferPlan, plan_buffer
from trellis.train.build import ModelFactory, ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import GraphData, load_labels
from trellis.train.options import NO_BUFFER_SAMPLERS, NO_RANKS_CACHE
from trellis.train.strategies.batches import BatchStrategy
from trellis.train.strategies.outofcore import budget_and_baseline
from trellis.train.strategy import Prediction, PredictRequest, saved_model
from trellis.utils.memory import proc_status
from trellis.utils.sizes import parse_size
from trellis.utils.tempdirs import OwnedTempDir


def open_layout_for(cfg: TrainConfig, store: GraphStore) -> PartitionedGraph:
    """The layout of ``--parts-dir``, checked against the store and the buffer's needs.

    Raises:
        TrellisUserError: Missing or damaged, made from another store, not destination-owned, or without features.
    """
    assert cfg.parts_dir is not None
    layout = open_layout_of(cfg.parts_dir, store)
    if layout.ownership != "dst":
        raise TrellisUserError(f"--parts-dir {cfg.parts_dir}: a partition buffer needs each node's in-edges in its own "
                               f"part (ownership dst), this layout's is {layout.ownership!r}; partition with "
                               f"{', '.join(methods_of_ownership('dst'))}")
    if not layout.manifest.get("num_features"):
        raise TrellisUserError(f"--parts-dir {cfg.parts_dir}: the layout has no node features; train with another "
                               "strategy, or import the store with features and re-partition")
    return layout


def label_skew(node_part: np.ndarray, train_ids: np.ndarray, y: np.ndarray, num_parts: int) -> float:
    """How far the parts' training labels are from the whole training set's: the mean total-variation distance.

    Why it matters: a buffer state trains on the targets of its K resident parts. When parts follow the labels
    (min-cut partitions of a homophilous graph), a state's steps see few classes and training degrades sharply
    (docs/minibatch.md: a 1M-node planted graph at 2 of 16 GREM parts trains to chance). 0 = every part holds
    the global label mix; 1 = parts hold disjoint classes. Multiclass labels only (0 otherwise).
    """
    if y.ndim != 1 or train_ids.size == 0:
        return 0.0
    labels = y[train_ids].astype(np.int64)
    classes = int(labels.max()) + 1
    parts = node_part[train_ids].astype(np.int64)
    hist = np.bincount(parts * classes + labels, minlength=num_parts * classes).reshape(num_parts, classes)
    sizes = hist.sum(axis=1)
    whole = hist.sum(axis=0) / max(1, int(sizes.sum()))
    share = hist / np.maximum(sizes, 1)[:, None]
    tv = 0.5 * np.abs(share - whole).sum(axis=1)
    return float((tv * sizes).sum() / max(1, int(sizes.sum())))


def layout_feature_norm(cfg: TrainConfig, store: GraphStore, layout: PartitionedGraph) -> str:
    """``--feature-norm`` resolved for features read from the layout (the store may hold none after a move)."""
    norm = cfg.feature_norm
    if norm == "auto":
        norm = (store.preferred_feature_norm if store.has("x") else
                feature_norm_of(np.load(layout.path / part_dir_name(0) / "x.npy", mmap_mode="r"))[0])
    moved = store.moved_to("x")
    if moved is not None and Path(moved).resolve() != Path(layout.path).resolve():
        print(f"note: {cfg.store}'s features were moved to {moved}; reading them from --parts-dir "
              f"{cfg.parts_dir}", file=sys.stderr)
    return norm


def store_edge_data(store: GraphStore, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The store's edge weights and edge features (float32, on ``device``), None where it has none."""
    ew, ef = (None if a is None else torch.from_numpy(np.array(a, dtype=np.float32)).to(device)
              for a in (store.edge_weight, store.edge_feat))
    return ew, ef


def replay_fanouts(cfg: TrainConfig) -> list[int]:
    """The rehearsal batches' fanouts: ``--buffer-replay-fanouts``, else the buffer's default for ``--fanouts``."""
    given = getattr(cfg, "buffer_replay_fanouts", None)
    if given:
        return parse_fanouts(given, cfg.layers)
    return default_replay_fanouts(parse_fanouts(cfg.fanouts, cfg.layers))


def expected_input_rows(batch: int, fanouts: list[int], degree: np.ndarray) -> int:
    """About the distinct input rows of a neighbour batch of ``batch`` targets: what its feature gather holds.

    Each hop draws ``min(fanout, degree)`` neighbours of every node of the hop before: the targets are uniform,
    the later hops' nodes are reached along edges, so weighted by degree (a symmetric graph's out-degree). The
    draws beyond the targets repeat nodes; counted as uniform draws over the other nodes (``n (1 - e^(-m/n))``
    distinct of ``m``), which overstates the distinct rows of draws that cluster around the targets. Why not
    ``batch × Π fanout``, capped at N, as before: on Coauthor CS (18k nodes, 6,805 features, degree 9) it
    priced every batch as the whole graph, 7.7k distinct rows measured against 18.3k, and the residency plan
    held 2.8 GiB of batches a run never used.
    """
    n = int(degree.shape[0])
    if n == 0:
        return 0
    deg = degree.astype(np.float64)
    weight = deg / max(1.0, float(deg.sum()))
    level = draws = float(min(batch, n))
    for i, f in enumerate(fanouts):
        take = deg if f <= 0 else np.minimum(deg, f)
        level *= float(take.mean() if i == 0 else (weight * take).sum())
        draws += level
    rest = n - min(batch, n)
    return int(min(n, min(batch, n) + rest * -np.expm1(-(draws - min(batch, n)) / max(1, rest))))


def neighbour_batch_bytes(cfg: TrainConfig, layout: PartitionedGraph, dim: int, degree: np.ndarray,
                          batch_size: int | None = None) -> int:
    """Bytes of the neighbour batches in flight (their input rows), and of the rehearsal batches kept."""
    batch = int(batch_size or cfg.batch_size)

    def rows_per_level(fanouts: list[int]) -> list[int]:  # targets first (at most; sampling repeats nodes)
        levels = [batch]
        for f in fanouts:
            levels.append(levels[-1] * (max(1, f) if f > 0 else 32))
        return levels

    inputs = expected_input_rows(batch, parse_fanouts(cfg.fanouts, cfg.layers), degree)
    levels = rows_per_level(replay_fanouts(cfg))  # a rehearsal batch's, at its own fanouts
    # a kept rehearsal batch of a built-in pushed-down model holds its first hop's rows and their first-layer
    # aggregations instead of its input rows (collapsed, loader.buffer.Kept)
    kept = 2 * sum(levels[:-1]) if cfg.model in PUSHDOWN_LAYERS else sum(levels)
    replay = min(layout.num_nodes, layout.num_parts * int(getattr(cfg, "buffer_replay", 0)) * kept // max(1, batch))
    # rehearsal rows are kept in 4 bits with a float32 scale each (loader.buffer.Kept)
    return int(inputs * dim * 4 * (cfg.prefetch + 2) * 1.5 + replay * ((dim + 1) // 2 + 4) * 1.5)


def plan_residency(cfg: TrainConfig, layout: PartitionedGraph, spec: ModelSpec, splits: dict[str, torch.Tensor],
                   budget: int | None, baseline: int, batch_bytes: tuple[int, int], *, cluster: bool = False,
                   parts: list[int] | None = None) -> BufferPlan:
    """The buffer's residency (parts resident, cache rows) for ``parts`` of ``layout`` (default: all of them).

    ``batch_bytes``: ``(fixed, per resident part)`` bytes of the batches in flight. A distributed rank plans its
    own parts against its own budget.
    """
    ids = list(range(layout.num_parts)) if parts is None else parts
    info = layout.manifest["parts"]
    rows = max(int(info[i]["num_local"]) for i in ids)
    edges = max(int(np.load(layout.path / part_dir_name(i) / "indices.npy", mmap_mode="r").shape[0]) for i in ids)
    dim, h = spec.in_dim, cfg.hidden
    params = dim * h * 2 + h * h * 2 * max(0, cfg.layers - 2) + h * spec.out_dim * 2
    scored = int(np.unique(torch.cat(list(splits.values())).cpu().numpy()).shape[0])
    # evaluation over the buffer: a chunk's working memory, and, where a hidden layer is wider than the features,
    # part slots of its width beside the training ones (buffer_inference's arena of a later layer)
    wide = h * (cfg.heads if cfg.model in ("gat", "gate") else 1)
    eval_slot = rows * wide * 4 if budget is not None and cfg.layers > 1 and wide > dim else 0
    costs = BufferCosts(layout.num_nodes, len(ids), rows, edges, dim * 4, params * 16, batch_bytes[0], baseline,
                        batch_bytes[1] + eval_slot,
                        eval_bytes=scored * (spec.out_dim * 4 * 2 + 16) + (EVAL_CHUNK_BYTES if budget else 0))
    given = getattr(cfg, "buffer_cache", None)
    cache = None if given is None else parse_size(given, flag="--buffer-cache")
    if cluster:
        cache = 0  # a cluster-batch is the induced subgraph of the resident parts: no rows from outside
    if parts is None and budget is None and cfg.buffer_parts in (None, layout.num_parts):
        cache = 0  # one process with every part resident: a cache would hold every row a second time, for nothing
    avg_degree = layout.num_edges / max(1, layout.num_nodes)
    return plan_buffer(costs, budget, buffer_parts=cfg.buffer_parts, cache_bytes=cache, avg_degree=avg_degree)


#: Label skew above which a buffer run with fewer parts resident than the layout has is warned about.
SKEW_WARNING = 0.25


class BufferedMini(BatchStrategy):
    """``--strategy mini`` over a partitioned layout with a partition buffer (see the module docstring)."""

    def load(self) -> None:
        """Open the store (labels, splits, degrees) and the layout; plan the residency; start the buffer."""
        cfg = self.cfg
        if cfg.feature_cache is not None:
            raise TrellisUserError(NO_RANKS_CACHE)
        if cfg.samplers > 0:
            raise TrellisUserError(NO_BUFFER_SAMPLERS)
        baseline = proc_status().get("RssAnon", 0)
        budget: int | None = None
        if cfg.memory_budget is not None:
            budget, baseline = budget_and_baseline(cfg, self.device)
        assert cfg.store is not None
        store = GraphStore(cfg.store)
        layout = open_layout_for(cfg, store)
        y, splits, task = load_labels(store, cfg.task, self.device, cfg.split_seed)
        norm = layout_feature_norm(cfg, store, layout)
        ew, ef = store_edge_data(store, self.device)
        node_part = np.asarray(np.load(layout.path / "node_parts.npy"), dtype=np.int32)
        x = NormalizedRows(LayoutRows(layout.path, node_part), norm)
        self.data = d = GraphData(store=store, graph=None, x=x, y=y, splits=splits, task=task, feature_norm=norm,
                                  edge_weight=ew, edge_feat=ef)
        self.store, self.task, self.feature_norm = store, task, norm
        self.spec = ModelSpec(d.in_dim, task.num_outputs, d.edge_dim, store.num_nodes, 0)
        self.indptr = np.asarray(store.indptr)
        self.indices = np.asarray(store.indices)
        self.layout = layout
        self.plan = self._plan(layout, budget, baseline)
        self.skew = label_skew(node_part, splits["train"].cpu().numpy(), np.asarray(store.y), layout.num_parts)
        self.last_epoch: dict[str, float] = {}
        self.loader = self.make_loader()

    def banner(self) -> str:
        """A warning when the resident parts follow the labels (training only: prediction reads every part)."""
        cfg, layout = self.cfg, self.layout
        if self.plan.capacity >= layout.num_parts or self.skew <= SKEW_WARNING or cfg.buffer_replay:
            return ""
        fix = ("raise --buffer-parts" if self.cluster_mode else
               "add --buffer-replay 512 (each step also trains kept batches of the parts not resident), or "
               "raise --buffer-parts")
        return (f"warning: the parts of {cfg.parts_dir} follow the labels (skew {self.skew:.2f}: mean total-variation "
                f"distance of a part's training labels from the whole set's). With {self.plan.capacity} of "
                f"{layout.num_parts} parts resident, each buffer state trains on few classes, which can cost much "
                f"accuracy; {fix} (docs/minibatch.md)")

    def _plan(self, layout: PartitionedGraph, budget: int | None, baseline: int) -> BufferPlan:
        rows = max(int(p["num_local"]) for p in layout.manifest["parts"])
        return plan_residency(self.cfg, layout, self.spec, self.data.splits, budget, baseline,
                              self._batch_bytes(layout, rows, self.spec.in_dim), cluster=self.cluster_mode)

    def _batch_bytes(self, layout: PartitionedGraph, part_rows: int, dim: int) -> tuple[int, int]:
        """Bytes of the batches in flight: ``(fixed, per resident part)`` (neighbour batches: fixed only)."""
        targets = int(self.data.splits["train"].shape[0])  # a batch holds at most every training node
        return neighbour_batch_bytes(self.cfg, layout, dim, np.diff(self.indptr), min(self.cfg.batch_size, targets)), 0

    def _fanouts(self) -> list[int]:
        return parse_fanouts(self.cfg.fanouts, self.cfg.layers)

    #: Cluster-batch mode (``--strategy cluster``): one batch per buffer state.
    cluster_mode = False
    predicts_on_cpu = "layer-wise inference over the partitioned layout"

    def make_loader(self) -> PartitionBuffer:
        """The partition buffer over the layout's parts."""
        cfg, d = self.cfg, self.data
        fanouts = self._fanouts()
        degree = np.diff(np.asarray(self.indptr)).astype(np.float32)
        buf = PartitionBuffer(self.layout, self.plan.capacity, fanouts, d.splits["train"].cpu().numpy(),
                              cfg.batch_size, y=d.y, degree=degree, feature_norm=self.feature_norm,
                              cache_rows=self.plan.cache_rows, labor=cfg.labor, device=self.device,
                              prefetch=cfg.prefetch, edge_weight=d.edge_weight, edge_feat=d.edge_feat,
                              cluster_layers=cfg.layers if self.cluster_mode else 0,
                              replay=0 if self.cluster_mode else cfg.buffer_replay,
                              replay_share=cfg.buffer_replay_share, replay_fanouts=replay_fanouts(cfg))
        if cfg.progress and self.plan.cache_rows:
            print(f"buffer: {self.plan.capacity} of {self.layout.num_parts} parts resident, cache of "
                  f"{self.plan.cache_rows:,} rows filled in {buf.cache_fill_s:.1f} s", file=sys.stderr)
        return buf

    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> torch.nn.Module:
        """The run's model; rehearsal batches are then kept with its first layer's aggregation where it has one."""
        model = super().build_model(factory, cfg)
        if getattr(getattr(self, "plan", None), "budget", None) is not None:
            check_buffer_inference(model)
        loader = getattr(self, "loader", None)
        if loader is not None and loader.replay:
            loader.collapse = input_aggregation(model)
        return model

    def _infer(self, model: torch.nn.Module, rows: np.ndarray | None = None) -> torch.Tensor:
        """Exact layer-wise inference without a budget; under one, layer-wise over the buffer (within it)."""
        if self.plan.budget is None:
            return super()._infer(model, rows)
        return self._buffer_inference(model, rows)

    def _buffer_inference(self, model: torch.nn.Module, rows: np.ndarray | None = None,
                          embeddings_to: Path | None = None) -> torch.Tensor:
        """Layer-wise inference over the buffer, its layer outputs spilled to a scratch directory.

        The scratch goes under ``--spill-dir``, else the run directory's ``spill/`` (as a budgeted full-batch
        run's): not ``$TMPDIR``, which may be a small file system the budget's spills were never meant for.
        """
        cfg = self.cfg
        root = Path(cfg.spill_dir) if cfg.spill_dir else (Path(cfg.out) / "spill" if cfg.out else None)
        made = root is not None and not root.exists()
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        try:
            with OwnedTempDir("trellis-eval-", dir=root) as tmp:
                return buffer_inference(model, self.loader, Path(tmp), rows=rows, device=self.device,
                                        chunk_bytes=EVAL_CHUNK_BYTES, embeddings_to=embeddings_to,
                                        first_input=self.first_input)
        finally:
            if made and root is not None:
                shutil.rmtree(root, ignore_errors=True)

    def begin_run(self, seed: int) -> None:
        """A run plans its first epoch afresh (as a resumed run at that point would)."""
        self.loader.reset()

    def state_dict(self) -> dict[str, Any]:
        """The buffer's last state (the next epoch starts from it) and the residency it was planned with."""
        return {"buffer": self.loader.state_dict(),
                "plan": {"capacity": self.plan.capacity, "cache_rows": self.plan.cache_rows}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, with the interrupted process's residency.

        Why the residency too: a budget's plan depends on the process's baseline, which a resuming process
        measures anew (its cache came out about 400 rows smaller), and another cache samples other
        neighbourhoods: the resumed epochs were not the uninterrupted run's.
        """
        saved = state.get("plan")
        if saved and (saved["capacity"], saved["cache_rows"]) != (self.plan.capacity, self.plan.cache_rows):
            collapse = self.loader.collapse
            self.loader.close()
            self.plan = replace(self.plan, capacity=int(saved["capacity"]), cache_rows=int(saved["cache_rows"]))
            self.loader = self.make_loader()
            self.loader.collapse = collapse
        self.loader.load_state_dict(state.get("buffer", {}))

    def epoch_info(self) -> dict[str, Any]:
        """The epoch's batches and the buffer's reads, waits and cache hits."""
        return {**self.last_epoch, **self.loader.stats.as_metrics()}

    def summary_info(self) -> dict[str, Any]:
        """The residency the run trained with."""
        p = self.plan
        return {**super().summary_info(), "buffer_parts": p.capacity, "num_parts": self.layout.num_parts,
                "cache_rows": p.cache_rows, "memory_budget_bytes": p.budget, "label_skew": self.skew,
                "evaluation": "exact" if p.budget is None else "buffer"}

    def explain(self, model: torch.nn.Module) -> str:
        """The residency table (the model's plan is the mini-batch one)."""
        return self.plan.table()

    def close(self) -> None:
        """Stop the buffer's reading thread."""
        loader = getattr(self, "loader", None)
        if loader is not None:
            loader.close()
        super().close()


    @classmethod
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """Inference over the run's layout: layer-wise through the buffer within the budget, exact without one.

        The features are read from the layout (the store may hold none after ``trellis partition
        --move-features``).
        """
        run_cfg, saved = req.run_cfg, req.saved
        budget = req.memory_budget or run_cfg.get("memory_budget")
        # without a budget inference is exact, so every part is resident (a run's --buffer-parts is for training)
        keep = {k: run_cfg[k] for k in ("strategy", "model", "parts_dir", "buffer_parts", "buffer_cache", "fanouts",
                                        "batch_size", "layers", "hidden", "task", "split_seed", "labor")
                if run_cfg.get(k) is not None and not (budget is None and k in ("buffer_parts", "buffer_cache"))}
        keep["strategy"] = "cluster" if cls.cluster_mode else "mini"  # a partition-parallel full run's layout too
        cfg = TrainConfig.from_dict({**keep, "store": req.store, "nproc": 1, "device": "cpu", "progress": False,
                                     "feature_norm": saved["feature_norm"], "memory_budget": budget,
                                     "spill_dir": req.spill_dir})
        strategy = cls(cfg, torch.device("cpu"))
        strategy.load()
        try:
            model = saved_model(req)
            model.load_state_dict(saved["state_dict"])
            model.eval()
            if embeddings_to is None or not hasattr(model, "convs") or getattr(model, "jk", "none") != "none" \
                    or getattr(model, "pre_norm", False):
                logits = strategy.predict(model)  # layer-wise inference does not write a --jk/--pre-norm embedding
                return Prediction(logits, logits, "logits")
            # the last layer's input, as a run in memory writes it (without a budget every part is resident)
            logits = strategy._buffer_inference(model, embeddings_to=embeddings_to)
            source = "penultimate" if len(getattr(model, "convs", ())) > 1 else "features"
            return Prediction(logits, None, source, int(np.load(embeddings_to, mmap_mode="r").shape[1]))
        finally:
            strategy.close()


class BufferedCluster(BufferedMini):
    """``--strategy cluster --parts-dir``: GraphTheta's cluster-batch with clusters = the buffer's resident parts.

    Every buffer state is one batch: the subgraph induced by its K resident parts (GCN normalizes by the
    subgraph's degrees, as Cluster-GCN does), with the loss on the training nodes the state was assigned, so
    each is a target once per epoch. The reads, the residency plan and the evaluation are the mini-batch
    buffer's.
    """

    cluster_mode = True

    def _fanouts(self) -> list[int]:
        return [-1] * self.cfg.layers

    def _batch_bytes(self, layout: PartitionedGraph, part_rows: int, dim: int) -> tuple[int, int]:
        """A cluster-batch holds every resident row: its inputs and activations scale with K."""
        width = max(dim, self.cfg.hidden)
        return 0, int(part_rows * width * 4 * (self.cfg.prefetch + 2) * 1.5)


__all__ = ["BufferedCluster", "BufferedMini", "label_skew", "layout_feature_norm", "neighbour_batch_bytes",
           "open_layout_for", "plan_residency", "store_edge_data"]
