"""The training-strategy interface and its registry: what one epoch, one evaluation and one prediction are.

Why this seam: the trainer's loop (runs over seeds, early stopping, checkpoints, the run directory, timing
and memory) is the same for every way of feeding a model, while *what is loaded* and *what a step is*
differ: the whole graph in memory (``full``), sampled blocks or cluster subgraphs read from memory maps
(``mini``, ``cluster``), pre-propagated rows (``pp``) — and next an out-of-core tiled engine and a
distributed rank's partition. Each is a :class:`Strategy` subclass registered by name with
:func:`register_strategy`; the CLI's ``--strategy`` choices are the registry's names, and a new strategy is
one module in :mod:`trellis.train.strategies`.

A strategy owns its data: :meth:`Strategy.load` opens the store (or cache, or partition) and keeps what
it needs; nothing is loaded before the strategy exists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.partition.layout import layout_identity
from trellis.train.build import ModelFactory, ModelSpec, build_run_model, default_model_factory, make_model
from trellis.train.config import TrainConfig
from trellis.train.data import check_edge_weights
from trellis.train.loop import Lane, ModelBatch, SoloBatch
from trellis.train.tasks import Task
from trellis.train.world import LOCAL, World


@dataclass
class PredictRequest:
    """What ``trellis predict`` asks a strategy for: logits of every node of ``store`` from a saved model.

    Attributes:
        saved: The model file's contents (``models/run-N.pt``: weights and what rebuilds the model).
        run_dir: The run directory.
        run_cfg: The run's ``config.json``.
        store: The store to predict on (features of the width the model was trained on).
        device: ``auto|cpu|cuda[:N]``.
        memory_budget: Cap on peak ``RssAnon`` (None: in memory, or the run's own for an out-of-core run).
        spill_dir: Where spill files go (None: the run's, else ``RUN_DIR/spill``).
        model_factory: Builds message-passing models by name.
    """

    saved: dict[str, Any]
    run_dir: Path
    run_cfg: dict[str, Any]
    store: str
    device: str = "auto"
    memory_budget: str | None = None
    spill_dir: str | None = None
    model_factory: ModelFactory | None = None


@dataclass
class Prediction:
    """A strategy's answer to a :class:`PredictRequest`.

    Attributes:
        logits: ``[N, C]``.
        embeddings: ``[N, D]`` node embeddings, None when the strategy wrote them itself (``embedding_dim`` set).
        embedding_source: ``penultimate``, ``features`` or ``logits``.
        embedding_dim: Width of embeddings written by the strategy itself.
    """

    logits: Tensor
    embeddings: Tensor | None
    embedding_source: str
    embedding_dim: int = 0


def saved_model(req: PredictRequest) -> nn.Module:
    """The model of a saved run rebuilt by its factory (weights not loaded: a wrapper may hold them)."""
    saved = req.saved
    return make_model(req.model_factory or default_model_factory, saved["model"], saved["in_dim"], saved["out_dim"],
                      edge_dim=saved["edge_dim"], **saved["kwargs"])


class Strategy(ABC):
    """One way of training: loads its data, trains an epoch, evaluates, predicts, saves its own state.

    Lifecycle (driven by :class:`trellis.train.trainer.Trainer`): ``load()`` once; per run
    ``build_model()``, ``begin_run(seed)``, then per epoch ``train_step()`` and ``evaluate()``;
    ``close()`` at the end. Between epochs :meth:`state_dict` / :meth:`load_state_dict` carry whatever
    the strategy itself must restore for an exact ``--resume`` (the RNGs are the trainer's).

    Args:
        cfg: The run's configuration.
        device: Where the model trains.

    Attributes (set by :meth:`load`):
        store: The graph store.
        task: The prediction task (labels, loss, metrics).
        spec: Widths the model is built from.
        feature_norm: The resolved ``--feature-norm``.
    """

    #: ``--strategy`` name (set by :func:`register_strategy`).
    name: ClassVar[str] = ""
    #: Splits :meth:`evaluate` scores each epoch (the summary reports these).
    eval_splits: ClassVar[tuple[str, ...]] = ("train", "val", "test")

    store: GraphStore
    task: Task
    spec: ModelSpec
    feature_norm: str = "none"

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """The class that runs ``cfg`` under this strategy's name (a variant chosen by its options)."""
        return cls

    @classmethod
    def check_options(cls, cfg: TrainConfig) -> None:
        """Refuse what this variant cannot run beyond its options' own rules.

        The options' rules are checked with the config (:mod:`trellis.train.options`); a variant adds what
        depends on how it runs, e.g. model options whose result would depend on a split across ranks.

        Raises:
            TrellisUserError: Names the flag.
        """
        return None  # a hook: most variants need nothing beyond their options' rules

    # ---- data -----------------------------------------------------------------------------------
    @abstractmethod
    def load(self) -> None:
        """Open the store and load what this strategy trains on; refuse bad input with a user error."""

    def open(self, edge_weight: bool) -> None:
        """:meth:`load`, then refuse ``--edge-weight`` on a store whose weights cannot be used.

        What ``load`` opened is closed on refusal; the trainer and the sweep both open their data this way.
        """
        self.load()
        if edge_weight:
            try:
                check_edge_weights(self.store)
            except TrellisUserError:
                self.close()
                raise

    @property
    def checksum(self) -> str:
        """Content checksum of what the run trains on (a resumed run must find the same)."""
        return str(self.store.checksum)

    def derived_inputs(self) -> dict[str, Any]:
        """What the run trains on besides the store, built from it (a layout, a pre-propagation cache's settings).

        A resumed run must find the same; the checkpoint records it. A layout is named by its method, part
        count and the checksum of its node-to-part map: a PART_DIR re-partitioned in place between a kill and
        its ``--resume`` trained the rest of the run on other parts, silently.
        """
        parts = getattr(self.cfg, "parts_dir", None)
        return {"layout": layout_identity(parts)} if parts else {}

    @property
    def num_edges(self) -> int:
        """Edges of the graph (for the summary)."""
        return int(self.store.num_edges)

    def banner(self) -> str:
        """A line the trainer prints once the data is loaded (e.g. a placement decision); empty for none."""
        return ""

    # ---- the model ------------------------------------------------------------------------------
    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> nn.Module:
        """The model of a run of ``cfg`` (default: this strategy's); the caller has just seeded every RNG.

        ``cfg`` differs from the strategy's own in a sweep: many configurations over one strategy's data.
        """
        return build_run_model(cfg or self.cfg, self.spec, factory)

    def model_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """What ``models/run-N.pt`` of a run of ``cfg`` records beside the weights (for ``trellis predict``).

        ``cfg`` rather than the strategy's own: a sweep saves many configurations over one strategy's data.
        """
        return {}

    # ---- training -------------------------------------------------------------------------------
    #: Whether :meth:`open_batch` shares one step between several configurations (a sweep's K may exceed 1).
    batches_models: ClassVar[bool] = False
    #: How :meth:`predict_saved` predicts when that runs on the CPU only (None: on ``--device``); a GPU asked
    #: for is then refused, not silently ignored.
    predicts_on_cpu: ClassVar[str | None] = None

    def open_batch(self, lanes: list[Lane], *, keep_splits: Sequence[str] | None = None,
                   splits: dict[str, Tensor] | None = None) -> ModelBatch:
        """The step the epoch loop drives for ``lanes`` (:func:`trellis.train.loop.run_epochs`).

        By default one configuration through :meth:`train_step` and :meth:`evaluate`; strategies that
        can share their reads between configurations override it (and set :attr:`batches_models`).

        Args:
            lanes: The configurations (their models, optimizers and dropout generators).
            keep_splits: Splits to score (None: :attr:`eval_splits`); a tune's search leaves out the test split.
            splits: Node ids of each split to train and score on instead of the store's (a tune's final runs
                over redrawn splits).

        Raises:
            TrellisUserError: Several configurations, or ``splits``, for a strategy that cannot take them.
        """
        if len(lanes) != 1:
            raise TrellisUserError(f"--strategy {self.name} trains one configuration at a time (got {len(lanes)})")
        if splits is not None:
            raise TrellisUserError(f"--strategy {self.name} trains on the store's split only; redrawn splits "
                                   "need --strategy full")
        return SoloBatch(self, lanes[0].model, lanes[0].generator, keep_splits)

    def batch_size_for(self, models: list[nn.Module], budget_bytes: float, override: int | None,
                       ) -> tuple[int, str, list[dict[str, Any]]]:
        """How many of ``models`` (one sweep group) share a step: ``(K, why, estimate rows)``.

        Raises:
            TrellisUserError: ``--batch-models`` above what this strategy can share.
        """
        if override not in (None, 1):
            raise TrellisUserError(f"--batch-models {override}: --strategy {self.name} trains one configuration at "
                                   "a time; drop --batch-models")
        return 1, f"K = 1: --strategy {self.name} trains one configuration at a time", []

    def epoch_weight(self, model: nn.Module) -> float:
        """``model``'s estimated work per epoch beside others of its batch (:attr:`Lane.weight`).

        A strategy with a cost model for its models says how their epochs compare, so that a batch's wall
        time is divided in proportion (what a tune prices its final runs from); 1.0 splits it equally.
        """
        return 1.0

    def begin_run(self, seed: int) -> None:  # noqa: B027 - optional hook
        """A run with ``seed`` starts (or resumes): reset per-run data state."""

    @abstractmethod
    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """Train one epoch; returns its training loss (a 0-d tensor, not synchronized)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """``<split>_<metric>`` for :attr:`eval_splits` and every metric of the task, plus ``val_loss``."""

    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node (``trellis predict``); strategies that cannot say so."""
        raise TrellisUserError(f"--strategy {self.name} cannot predict every node")

    @classmethod
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """``trellis predict`` with a model this strategy trained.

        ``embeddings_to`` is where the embeddings go when the strategy writes them itself (tile by tile); None
        when only the logits are wanted (``Run.predict``), so no strategy computes embeddings for nothing.

        Raises:
            TrellisUserError: The strategy cannot predict every node, or the store does not fit the model.
        """
        raise TrellisUserError(f"--strategy {cls.name} cannot predict every node")

    def explain(self, model: nn.Module) -> str:
        """The plan ``--explain`` prints for this strategy and model."""
        explain = getattr(model, "explain", None)
        if explain is None:
            return f"{self.cfg.model}: this model does not describe its plan"
        return str(explain(self.explain_graph()))

    def explain_graph(self) -> Any:
        """The graph a model's own ``explain`` describes its plan on."""
        raise TrellisUserError(f"--strategy {self.name}: --explain is not available")

    # ---- state, summary, teardown -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The strategy's own resumable state (RNGs excluded: the trainer saves those)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore :meth:`state_dict`."""

    def summary_info(self) -> dict[str, Any]:
        """Fields only this strategy reports in ``summary.json``."""
        return {}

    def epoch_info(self) -> dict[str, Any]:
        """Fields only this strategy adds to each epoch's record in ``metrics.jsonl`` (e.g. spill traffic)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and threads."""

    # ---- several processes ----------------------------------------------------------------------
    #: The processes this strategy trains in (:mod:`trellis.train.world`): one, unless it trains across ranks
    #: (then rank 0 writes the run directory and its peers a scratch directory removed at the end).
    world: World = LOCAL


#: ``--strategy`` name -> class.
STRATEGIES: dict[str, type[Strategy]] = {}

def register_strategy(name: str) -> Any:
    """Class decorator that registers a :class:`Strategy` under ``name``."""

    def deco(cls: type[Strategy]) -> type[Strategy]:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return deco


def strategy_class(name: str) -> type[Strategy]:
    """The registered strategy ``name``; a user error listing the registered ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise TrellisUserError(f"unknown --strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
