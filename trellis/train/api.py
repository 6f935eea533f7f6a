"""The library's front door: ``trellis.train(...)`` returns a :class:`Run`; ``trellis.load_run`` reads one back.

Why a separate entry point from :class:`~trellis.train.trainer.Trainer`: a notebook caller wants a trained
model and its history, not a directory, a signal handler or a progress bar it did not ask for, and wants its
own objects left alone. :func:`train` therefore builds the same :class:`TrainConfig` the CLI builds (so every
option and every error is the CLI's, as a :class:`~trellis.errors.TrellisUserError`), runs the one trainer
loop without installing signal handlers, writes a run directory only when ``out`` is given, and keeps the
models in memory. ``trellis train`` and ``trellis.train(..., out=DIR)`` write the same ``summary.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trellis.data.convert import PYG_MASKS, from_arrays, from_pyg
from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.nn.models import MODELS, register_model
from trellis.train.build import check_registered, default_model_factory, make_model
from trellis.train.config import TrainConfig, check_keys, load_config_file
from trellis.train.features import NodeEmbedding
from trellis.train.runs import iter_jsonl, open_run_dir, read_json
from trellis.train.tasks import TASKS, Task
from trellis.utils.caller import keeps_caller_state
from trellis.utils.tempdirs import OwnedTempDir

#: What :func:`train` accepts as the graph.
GraphLike = str | os.PathLike[str] | GraphStore | Any


@dataclass
class Run:
    """A finished training job: its models, per-epoch history and summary.

    Attributes:
        summary: What ``summary.json`` holds (``run_dir`` is None when no directory was written).
        history: One record per epoch and run, as in ``metrics.jsonl``.
        models: Per run (seed), the best-validation model.
        config: The resolved configuration.
        run_dir: The run directory, or None.
        headers: Per run, what its model file holds beside the weights (what rebuilds and checks the model).
    """

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    models: list[nn.Module]
    config: TrainConfig
    run_dir: Path | None = None
    headers: list[dict[str, Any]] = field(default_factory=list)
    _keep: Any = field(default=None, repr=False)  # a temporary store the run trained on, kept alive with it
    _store: str | None = field(default=None, repr=False)  # the store's absolute path (the caller may chdir)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) does not own the temporary store an in-memory graph was written to."""
        return {**self.__dict__, "_keep": None}

    @property
    def model(self) -> nn.Module:
        """The best-validation run's model."""
        return self.models[int(self.summary["best_run"])]

    @property
    def metric(self) -> str:
        """The metric early stopping selected on (``acc``, ``f1_macro``, ...)."""
        return str(self.summary["metric"])

    def test_score(self) -> float:
        """Mean test value of :attr:`metric` over the runs."""
        return float(self.summary[f"test_{self.metric}_mean"])

    @keeps_caller_state
    @torch.no_grad()
    def predict(self, store: GraphLike | None = None, *, run: int | None = None,
                proba: bool = False, logits: bool = False, device: str | None = None) -> Tensor:
        """Predictions for every node of ``store`` (default: the store the run trained on).

        The run's strategy predicts, as it evaluated during training (a buffer run reads its layout, a
        budgeted full-batch run tiles). Multiclass: class ids ``[N]`` (``proba``: softmax ``[N, C]``);
        binary and multilabel as ``trellis predict`` writes them; ``logits`` returns the raw outputs.

        Args:
            store: A graph with the training features' width, as :func:`train` takes it (default: the run's own).
            run: Which run's model (default: the best-validation one).
            proba: Probabilities instead of predictions.
            logits: The model's raw outputs.
            device: ``auto|cpu|cuda[:N]`` (default: the run's).
        """
        from trellis.train.predict import predict_saved

        r = int(self.summary["best_run"]) if run is None else run
        if not 0 <= r < len(self.models):
            raise TrellisUserError(f"run={r}: this Run has runs 0..{len(self.models) - 1}")
        own = self.models[r]
        inner = own.model if isinstance(own, NodeEmbedding) else own

        def this_module(*_args: Any, **_kwargs: Any) -> nn.Module:
            """The run's own module (a copy): not what a name in the registry builds now."""
            return copy.deepcopy(inner)

        saved = {**self.headers[r], "state_dict": own.state_dict()}
        path, keep = as_store(store, to_train=False) if store is not None else (self._default_store(), None)
        with OwnedTempDir("trellis-predict-") as scratch:  # an out-of-core run's spill
            out = predict_saved(saved, self.run_dir or Path(scratch), self.config.to_dict(), path,
                                device=device or self.config.device, model_factory=this_module).logits
        del keep
        if logits:
            return out
        task: Task = TASKS[self.summary["task"]](int(self.summary["num_classes"]))
        pred, prob = task.predict(out)
        return prob if proba else pred


    def _default_store(self) -> str:
        """The store the run trained on; a clear error where it was a temporary one that is gone."""
        path = self._store or str(self.config.store)
        if self._keep is None and Path(path).name == "store" and Path(path).parent.name.startswith(TEMP_STORE) \
                and not Path(path).is_dir():
            raise TrellisUserError("this Run trained on an in-memory graph, whose temporary store went with the Run "
                                   "it was copied from; pass the graph again: run.predict(graph)")
        return path


#: Prefix of the temporary directory an in-memory graph is written to.
TEMP_STORE = "trellis-store-"


def _store_path(data: str | os.PathLike[str] | GraphStore) -> str:
    return str(data.path) if isinstance(data, GraphStore) else os.fspath(data)


def as_store(data: GraphLike, tmp: str | None = None, *, to_train: bool = True) -> tuple[str, Any]:
    """A store path for ``data``, and what must stay alive while it is used (a temporary store's directory).

    ``data`` is a store path, a :class:`GraphStore`, a PyG-style ``Data`` (``edge_index``; written with
    :func:`trellis.data.from_pyg`) or a mapping of arrays (``src``, ``dst``, ``x``, ``y``, ``splits``...,
    the arguments of :func:`trellis.data.from_arrays`). A graph object ``to_train`` on must carry its splits:
    the message names the object's missing attribute (not the temporary store's file, nor `trellis data
    import`); one to predict on needs none.
    """
    if isinstance(data, (str, os.PathLike, GraphStore)):
        return _store_path(data), None
    if hasattr(data, "edge_index"):
        missing = [k for k, names in PYG_MASKS if all(getattr(data, a, None) is None for a in names)]
        if to_train and missing:
            raise TrellisUserError(f"the Data has no {missing[0]}_mask: training needs train_mask, val_mask and "
                                   "test_mask (boolean [N] masks, [N, S] masks of S splits, or node ids)")
        keep = OwnedTempDir(TEMP_STORE, dir=tmp)
        return str(from_pyg(data, Path(keep.name) / "store")), keep
    if isinstance(data, dict):
        if "src" not in data or "dst" not in data:
            raise TrellisUserError("a graph given as a dict needs 'src' and 'dst' edge arrays (the arguments of "
                                   "trellis.data.from_arrays)")
        missing = [k for k in ("train", "val", "test") if (data.get("splits") or {}).get(k) is None]
        if to_train and missing:
            raise TrellisUserError(f"a graph given as a dict needs splits={{'train': ids, 'val': ids, 'test': ids}} "
                                   f"(node ids or boolean masks of each split) to train and evaluate on; it has no "
                                   f"{missing[0]!r} split")
        keep = OwnedTempDir(TEMP_STORE, dir=tmp)
        return str(from_arrays(out=Path(keep.name) / "store", **data)), keep
    raise TrellisUserError(f"cannot train on a {type(data).__name__}: pass a store path, a GraphStore, a PyG Data "
                           "or a dict of arrays (trellis.data.from_arrays)")


def model_option(model: str | Callable[..., nn.Module] | None) -> str | None:
    """``model=`` as a name, or a builder ``(in_dim, out_dim, **hparams) -> Module`` registered under its name.

    A builder is registered in :data:`trellis.nn.models.MODELS` (so the config accepts its name and a saved
    run can be rebuilt in this process) and receives the hyperparameters it declares (``hidden``,
    ``layers``, ``dropout``, ...).
    """
    if model is None or isinstance(model, str):
        return model
    if not callable(model):
        raise TrellisUserError(f"model={model!r}: pass a model name ({', '.join(MODELS)}) or a builder "
                               "(in_dim, out_dim, **hparams) -> torch.nn.Module")
    name = getattr(model, "__name__", "").lower()
    if not name.isidentifier():
        raise TrellisUserError("model=: a builder needs a name (a function or class, not a lambda); it is "
                               "recorded in the run's config")
    try:
        register_model(name, model)
    except ValueError as exc:
        raise TrellisUserError(f"model={name}: {exc}; rename the builder") from None
    return name


def _config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The options of ``config=`` (``trellis train --config``: JSON, TOML or a run's ``config.json``).

    Its store, out and resume are not used: the graph is the first argument, and nothing is written unless
    ``out=`` asks (a run's ``config.json`` names that run's directory).
    """
    if path is None:
        return {}
    values = load_config_file(os.fspath(path))
    check_keys(values, f"config={path}")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    return {k: v for k, v in values.items() if k not in ("store", "out", "resume", "overwrite")}


@keeps_caller_state
def train(data: GraphLike, /, *, out: str | os.PathLike[str] | None = None, progress: bool = False,
          model: str | Callable[..., nn.Module] | None = None, **options: Any) -> Run:
    """Train a GNN and return the :class:`Run` (``trellis train`` as a function).

    Args:
        data: A store path, a :class:`GraphStore`, a PyG ``Data`` or a dict of arrays (see :func:`as_store`).
        out: Write the run directory there (default: none; models and history stay in memory).
        progress: Show progress bars (``tqdm.auto``: a notebook widget in Jupyter).
        model: A model name (``gcn``, ``sage``, ...) or a builder ``(in_dim, out_dim, **hparams) -> Module``.
        **options: Any ``trellis train`` option by its field name (``epochs=50``, ``lr=0.005``,
            ``strategy="mini"``, ``fanouts="10,5"``); values are validated as the CLI validates flags.
            ``config=FILE`` reads options from a file as ``--config`` does (those given here win; its store
            and out are not used).

    Raises:
        TrellisUserError: A bad option or store (the CLI's message, which names the flag).
    """
    from trellis.train.trainer import Trainer

    for bad in ("store", "resume", "json", "explain"):
        if bad in options:
            raise TrellisUserError(f"trellis.train: {bad}= is not an option here "
                                   + {"store": "(pass the graph as the first argument)",
                                      "resume": "(use trellis.resume(run_dir))",
                                      "json": "(the Run is the result)",
                                      "explain": "(use trellis.explain(...))"}[bad])
    name = model_option(model)
    base = _config_file(options.pop("config", None))
    path, keep = as_store(data)
    values = {**base, **options, "store": path, "progress": progress}
    if name is not None:
        values["model"] = name
    if out is not None:
        values["out"] = os.fspath(out)
    cfg = TrainConfig.from_dict(values, source="trellis.train")
    spills = None
    if out is None and cfg.memory_budget is not None and not cfg.spill_dir:
        # nothing is written unless asked: the spills go to a temporary directory, not ./runs/STORE-MODEL/spill
        spills = OwnedTempDir("trellis-spill-")
        try:
            cfg = TrainConfig.from_dict({**values, "spill_dir": spills.name}, source="trellis.train")
        except TrellisUserError:  # a strategy that spills nothing under this budget (pp): it takes no --spill-dir
            spills.cleanup()
            spills = None
    from trellis.train.launch import needs_launch, train_ranks

    if needs_launch(cfg):
        if out is None:
            raise TrellisUserError("trellis.train: a run over several processes (nproc > 1) needs out= (the ranks "
                                   "write their models there)")
        train_ranks(cfg, quiet=not progress)
        return load_run(cfg.out or "")
    trainer = Trainer(cfg, handle_signals=False, run_dir=out is not None, keep_models=True, quiet=not progress)
    try:
        summary = trainer.fit()
    finally:
        if spills is not None:
            spills.cleanup()
    config = dataclasses.replace(trainer.cfg, spill_dir=None) if spills is not None else trainer.cfg
    return Run(summary, trainer.history, trainer.models, config,
               Path(summary["run_dir"]).resolve() if summary.get("run_dir") else None, trainer.headers, _keep=keep,
               _store=str(Path(path).resolve()))


@keeps_caller_state
def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """A finished run directory as a :class:`Run` (models rebuilt from ``models/run-*.pt``)."""
    paths = open_run_dir(run_dir)
    if not paths.summary.is_file():
        raise TrellisUserError(f"{paths.root}: the run has not finished (no summary.json); continue it with "
                               f"`trellis train --resume {paths.root}`")
    summary = dict(read_json(paths.summary))
    saved_cfg = read_json(paths.config)
    check_registered(str(saved_cfg.get("model")), str(paths.root))
    cfg = TrainConfig.from_dict(saved_cfg, source=f"{paths.config}")
    models, headers = [], []
    for r in range(len(summary["seeds"])):
        saved = torch.load(paths.model(r), map_location="cpu", weights_only=True)
        if "kwargs" not in saved:
            raise TrellisUserError(f"{paths.model(r)}: a {saved.get('model')} model file of an older trellis cannot "
                                   "be rebuilt as a module here; use trellis.predict(run_dir, store, out)")
        headers.append({k: v for k, v in saved.items() if k != "state_dict"})
        m: nn.Module
        if saved.get("strategy") == "pp":  # a dense model over the cache's hops (pre-propagation)
            from trellis.nn.pp_models import build_pp_model

            m = build_pp_model(saved["model"], saved["num_features"], saved["hops"], saved["out_dim"],
                               **saved["kwargs"])
        else:
            m = make_model(default_model_factory, saved["model"], saved["in_dim"], saved["out_dim"],
                           edge_dim=saved["edge_dim"], **saved["kwargs"])
            features = str(saved.get("features", "store"))
            if features.startswith("embedding:"):
                m = NodeEmbedding(m, saved["num_nodes"], int(features.split(":", 1)[1]))
        m.load_state_dict(saved["state_dict"])
        models.append(m.eval())  # as trellis.train's: ready to evaluate
    return Run(summary, list(iter_jsonl(paths.metrics)), models, cfg, paths.root, headers)


def _duration(budget: str | float | None) -> float | None:
    """``budget=``: a number is seconds; a string reads as ``--budget`` (``"90s"``, ``"20m"``; bare: minutes)."""
    from trellis.train.tune import parse_duration

    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TrellisUserError(f"budget={budget!r}: give seconds (a number) or a duration such as '20m'")
    if isinstance(budget, str):
        return parse_duration(budget, "budget=")
    if not (math.isfinite(budget) and budget > 0):
        raise TrellisUserError(f"budget={budget!r}: the duration must be positive")
    return float(budget)


def _grid_values(key: str, values: Any) -> str:
    """A grid entry as the CLI's ``--grid`` text: a list of values, one value, or the CLI's ``"0.01,0.02"``."""
    if isinstance(values, str):
        return values
    if isinstance(values, (int, float, bool)):
        return str(values)
    try:
        return ",".join(str(v) for v in values)
    except TypeError:
        raise TrellisUserError(f"grid {key}={values!r}: give a list of values (or one value)") from None


@keeps_caller_state
def sweep(store: GraphLike, grid: dict[str, list[Any]], /, *, model: str = "gcn", out: str | os.PathLike[str] | None
          = None, epochs: int | None = None, patience: int | None = None, seed: int = 0, device: str = "auto",
          batch_models: int | None = None, progress: bool = False, **base: Any) -> dict[str, Any]:
    """``trellis sweep`` as a function: every combination of ``grid``, model-batched; returns the leaderboard.

    Args:
        store: The graph (as :func:`train` takes it).
        grid: ``{hyperparameter: [values]}``, e.g. ``{"lr": [0.01, 0.005], "hidden": [64, 128]}``.
        model: Model family.
        out: SWEEP_DIR to write (default: none; a scratch directory is removed afterwards).
        epochs: Maximum epochs per configuration.
        patience: Early-stopping patience.
        seed: Seed of every configuration.
        device: ``auto|cpu|cuda[:N]``.
        batch_models: Configurations per batch (default: the planner's choice).
        progress: Progress bars.
        **base: Options every configuration shares (``trellis train`` fields, e.g. ``layers=3``).
    """
    from trellis.train.sweep import SweepConfig, parse_grid, run_sweep

    path, keep = as_store(store)
    items = [f"{k}={_grid_values(k, values)}" for k, values in grid.items()]
    with OwnedTempDir("trellis-sweep-") as scratch:
        sc = SweepConfig(store=path, model=model, grid=parse_grid(items), base=base, epochs=epochs, patience=patience,
                         seed=seed, device=device, batch_models=batch_models,
                         out=os.fspath(out) if out is not None else os.path.join(scratch, "sweep"),
                         progress=progress)
        board = run_sweep(sc)
    del keep
    return _written(board, out)


@keeps_caller_state
def tune(store: GraphLike, /, *, model: str = "gcn", space: dict[str, Any] | str | None = None,
         grid: dict[str, Any] | None = None, search: str = "auto",
         budget: str | float | None = None, out: str | os.PathLike[str] | None = None, candidates: int = 27,
         seeds: int = 3, splits: int | None = None, epochs: int | None = None, patience: int | None = None,
         min_epochs: int | None = None, eta: int = 3, seed: int = 0, playoff: int = 15, playoff_seeds: int = 3,
         batch_models: int | None = None, device: str = "auto", progress: bool = False,
         **base: Any) -> dict[str, Any]:
    """``trellis tune`` as a function: search on validation, retrain the choice over seeds; returns the board.

    Args:
        store: The graph (as :func:`train` takes it).
        model: Model family.
        space: ``None`` (the model's default space), a space as a dict (``{"lr": {"log_uniform": [1e-3, 0.05]},
            "hidden": [64, 128]}``) or a JSON space file.
        grid: A finite space as ``--grid`` gives it (``{"lr": [0.01, 0.005]}``), instead of ``space``.
        search: ``auto|grid|random`` (``--search``).
        budget: Wall time: a number is seconds; a string reads as ``--budget`` (``"90s"``, ``"20m"``, ``"1.5h"``;
            a bare number in a string is minutes, as on the command line). Default: the whole halving schedule.
        out: TUNE_DIR to write (default: none; a scratch directory is removed afterwards).
        candidates: Random candidates per bracket.
        seeds: Seeds of the final retraining.
        splits: Splits of the final retraining (``--splits``).
        epochs: Epochs of the last rung.
        patience: Early-stopping patience of every candidate.
        min_epochs: Epochs of the first rung (``--min-epochs``).
        eta: The halving factor (``--eta``).
        seed: Seed of the draws.
        playoff: Finalists retrained with ``playoff_seeds`` fresh seeds each before the choice (1: none).
        playoff_seeds: Fresh seeds per playoff finalist.
        batch_models: Candidates per batch (default: the planner's choice).
        device: ``auto|cpu|cuda[:N]``.
        progress: Progress bars.
        **base: Options every candidate shares (``trellis train`` fields).
    """
    import json

    from trellis.train.tune import TuneConfig, run_tune

    path, keep = as_store(store)
    with OwnedTempDir("trellis-tune-") as scratch:
        if isinstance(space, dict):  # the tune records its space file: write the dict as one
            from trellis.train.space import parse_space

            parse_space(space, "space=")  # a bad space is named as the caller gave it, not by the scratch file
            space_arg: str | None = os.path.join(scratch, "space.json")
            Path(os.path.join(scratch, "space.json")).write_text(json.dumps(space))
        else:
            space_arg = space
        tc = TuneConfig(store=path, model=model, space=space_arg, candidates=candidates, budget_s=_duration(budget),
                        grid=None if grid is None else [f"{k}={_grid_values(k, v)}" for k, v in grid.items()],
                        search=search, eta=eta, min_epochs=min_epochs, patience=patience, splits=splits,
                        batch_models=batch_models, epochs=epochs, seed=seed, seeds=seeds, playoff=playoff,
                        playoff_seeds=playoff_seeds, base=base, device=device, progress=progress,
                        out=os.fspath(out) if out is not None else os.path.join(scratch, "tune"))
        board = run_tune(tc)
    del keep
    return _written(board, out)


def _written(board: dict[str, Any], out: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The board, its ``out`` None where nothing was kept (as a Run's ``run_dir``), not a removed scratch path."""
    return board if out is not None else {**board, "out": None}


@keeps_caller_state
def explain(data: GraphLike, /, *, model: str | Callable[..., nn.Module] | None = None, **options: Any) -> str:
    """The operator plan ``trellis train --explain`` prints for these options; trains nothing."""
    from trellis.train.trainer import Trainer

    name = model_option(model)
    path, keep = as_store(data)
    values = {**options, "store": path, "progress": False}
    if name is not None:
        values["model"] = name
    cfg = TrainConfig.from_dict(values, source="trellis.explain")
    if cfg.parts_dir is not None and cfg.strategy == "full":  # the ranks' plan, described from here (as the CLI)
        from trellis.train.strategies.partitioned import explain_distributed

        text = explain_distributed(cfg, None)
    else:
        text = Trainer(cfg, handle_signals=False).explain()
    del keep
    return text


@keeps_caller_state
def resume(run_dir: str | os.PathLike[str]) -> Run:
    """Continue an interrupted run directory (``trellis train --resume``) and return the finished :class:`Run`.

    A run that already finished is returned as it is.
    """
    from trellis.train.trainer import Trainer

    paths = open_run_dir(run_dir, resume=True)
    if not paths.summary.is_file():
        saved = read_json(paths.config)
        check_registered(str(saved.get("model")), str(paths.root))
        cfg = TrainConfig.from_dict({**saved, "resume": str(paths.root), "progress": False},
                                    source=f"{paths.config}")
        from trellis.train.launch import needs_launch, train_ranks

        if needs_launch(cfg):  # a run over ranks resumes over ranks (in one process it trained a world of one)
            train_ranks(cfg, quiet=True)
        else:
            Trainer(cfg, handle_signals=False).fit()
    return load_run(paths.root)
