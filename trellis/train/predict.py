"""Inference with a trained run: predictions and node embeddings for every node of a store.

``trellis predict RUN_DIR STORE --out FILE.npy`` rebuilds the model from ``RUN_DIR/models/run-<r>.pt``
(the best-validation run by default), applies the same feature normalization the run trained with, and
writes ``FILE.npy`` (class ids, or probabilities with ``--proba``) and ``FILE_emb.npy`` (the input of
the last layer — the node embedding — when the model can return it, else the logits). The store may be
another graph with the same feature width (inductive use).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.ops.sparse_rows import is_sparse
from trellis.train.build import ModelFactory, check_registered
from trellis.train.config import TrainConfig
from trellis.train.runs import open_run_dir, read_json
from trellis.train.strategies import Strategy, strategy_class
from trellis.train.strategy import Prediction, PredictRequest
from trellis.train.tasks import TASKS
from trellis.train.trainer import MODEL_FORMAT
from trellis.utils.atomic import file_mode
from trellis.utils.caller import keeps_caller_state


def embedding_path(out: Path) -> Path:
    """``preds.npy`` -> ``preds_emb.npy``."""
    return out.with_name(out.stem + "_emb.npy")


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npy", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def choose_run(run_dir: Path, run: int | None) -> int:
    """The run whose weights predict uses: ``run`` if given, else the summary's best-validation run.

    A directory whose runs have not all finished (interrupted, resumable) has no summary yet: its last finished run.
    """
    paths = open_run_dir(run_dir)
    if run is None:
        if paths.summary.is_file():
            return int(read_json(paths.summary)["best_run"])
        done = sorted(int(p.stem.split("-")[1]) for p in paths.models.glob("run-*.pt"))
        if not done:
            raise TrellisUserError(f"{run_dir}: no run has finished yet (models/ is empty); resume it with "
                                   f"`trellis train --resume {run_dir}` first")
        run = done[-1]
    if not paths.model(run).is_file():
        raise TrellisUserError(f"--run {run}: {paths.model(run)} does not exist; choose a finished run")
    return run


@torch.no_grad()
@keeps_caller_state
def predict(run_dir: str | os.PathLike[str], store: str | os.PathLike[str] | None, out: str | os.PathLike[str], *,
            run: int | None = None, proba: bool = False, device: str = "auto",
            model_factory: ModelFactory | None = None, memory_budget: str | None = None,
            spill_dir: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write predictions and embeddings of every node of ``store``.

    Args:
        run_dir: A ``trellis train`` run directory.
        store: Graph store to predict on (features of the same width as in training); None: the store the run
            trained on (its ``config.json``'s).
        out: Output path ending in ``.npy``; embeddings go to ``<out stem>_emb.npy`` beside it.
        run: Which run's weights (default: the best-validation run).
        proba: Write probabilities instead of predictions (default: False). Multiclass: class ids ``[N]``
            or softmax probabilities ``[N, C]``; binary: 0/1 labels ``[N]`` or the positive class's
            probability ``[N]``; multilabel: a 0/1 ``uint8 [N, C]`` matrix or per-label probabilities.
        device: ``auto|cpu|cuda[:N]`` (default: auto).
        model_factory: Builds message-passing models by name (default: :func:`trellis.nn.build_model`).
        memory_budget: Cap on peak ``RssAnon``: tiled inference with spill files (default: the run's own
            ``--memory-budget`` when it trained full-batch under one, else in memory).
        spill_dir: Where spill files go (default: the run's ``--spill-dir``, else ``RUN_DIR/spill``).
        overwrite: Replace existing output files (default: refuse).

    Returns:
        A JSON-ready description of what was written.
    """
    out_path = Path(out)
    if out_path.suffix != ".npy":
        raise TrellisUserError(f"--out {out_path}: must end in .npy (embeddings go to <name>_emb.npy beside it)")
    if not out_path.parent.is_dir():
        raise TrellisUserError(f"--out {out_path}: directory {out_path.parent} does not exist")
    run_dir = Path(run_dir)
    r = choose_run(run_dir, run)
    if store is None:
        store = trained_store(run_dir)
    if not overwrite:
        for existing in (out_path, embedding_path(out_path)):
            if existing.exists():
                raise TrellisUserError(f"--out {out_path}: {existing} exists; choose another --out or pass --overwrite")
    saved = torch.load(open_run_dir(run_dir).model(r), map_location="cpu", weights_only=True)
    pp = saved.get("strategy") == "pp" or saved.get("format") == "trellis-pp-model"
    if not pp and saved.get("format") != MODEL_FORMAT:
        raise TrellisUserError(f"{run_dir}: models/run-{r}.pt is not a trellis model file")
    if model_factory is None:
        check_registered(str(saved.get("model")), str(run_dir))
    run_cfg = {} if pp else read_json(open_run_dir(run_dir).config)
    result = predict_saved(saved, run_dir, run_cfg, store, device=device, memory_budget=memory_budget,
                           spill_dir=spill_dir, model_factory=model_factory, embeddings_to=embedding_path(out_path))
    task = TASKS[saved.get("task", "multiclass")](saved.get("out_dim", saved.get("num_classes")))
    return _write(out_path, result.logits, result.embeddings, result.embedding_source, task, proba, r,
                  saved["model"], run_dir, emb_dim=result.embedding_dim)


def trained_store(run_dir: Path) -> str:
    """The store a run trained on, as its ``config.json`` records it (absolute), refused by name when gone."""
    paths = open_run_dir(run_dir)
    cfg = read_json(paths.config)
    store = cfg.get("store") if isinstance(cfg, dict) else None
    if not store:
        raise TrellisUserError(f"{paths.config} names no store; give the STORE to predict on")
    if not (Path(str(store)) / "manifest.json").is_file():
        raise TrellisUserError(f"{run_dir}: the store it trained on, {store}, is gone; give the STORE to predict on")
    return str(store)


def predict_saved(saved: dict[str, Any], run_dir: Path, run_cfg: dict[str, Any], store: str | os.PathLike[str], *,
                  device: str = "auto", memory_budget: str | None = None, spill_dir: str | None = None,
                  model_factory: ModelFactory | None = None, embeddings_to: Path | None = None) -> Prediction:
    """Logits of every node of ``store`` from a saved model (``models/run-N.pt``'s contents), as its run predicts.

    The one path of ``trellis predict``, :func:`predict` and ``Run.predict``: the run's strategy
    (:func:`prediction_strategy`) checks that the store fits the model and predicts. ``embeddings_to`` is where a
    strategy that writes the embeddings itself puts them (None: only the logits are wanted).
    """
    cls, budget = prediction_strategy(saved, run_cfg, store, memory_budget)
    if cls.predicts_on_cpu is not None and device not in ("auto", "cpu"):
        raise TrellisUserError(f"--device {device}: this run predicts by {cls.predicts_on_cpu}, which runs on the "
                               "CPU only; use --device cpu or auto")
    req = PredictRequest(saved, run_dir, run_cfg, str(store), device=device, memory_budget=budget,
                         spill_dir=spill_dir or run_cfg.get("spill_dir"), model_factory=model_factory)
    return cls.predict_saved(req, embeddings_to)


def prediction_strategy(saved: dict[str, Any], run_cfg: dict[str, Any], store: str | os.PathLike[str],
                        memory_budget: str | None) -> tuple[type[Strategy], str | None]:
    """The strategy class that predicts with a saved run, and the budget it predicts under.

    The run's own strategy as its options resolve it (``for_config``), in one process: a pre-propagation model
    reads its cache; a partition-buffer run (``--parts-dir`` with mini or cluster) its layout; a full-batch run
    under ``--memory-budget`` (or any run given one) tiles the store; everything else runs on the whole graph
    in memory.
    """
    if saved.get("strategy") == "pp" or saved.get("format") == "trellis-pp-model":
        return strategy_class("pp"), None
    name = run_cfg.get("strategy", "full")
    parts = run_cfg.get("parts_dir") if name in ("mini", "cluster") else None
    if name == "full" and memory_budget is None and run_cfg.get("parts_dir") and GraphStore(store).moved_to("x"):
        # a partition-parallel run whose store moved its features to the layout: the buffer's exact inference
        # reads them there (the same layer-wise function of the same model)
        name, parts = "mini", run_cfg["parts_dir"]
    if memory_budget is None and name == "full":
        memory_budget = run_cfg.get("memory_budget")
    if memory_budget is not None and parts is None:
        name = "full"  # tiled inference, whatever trained the model
    probe = TrainConfig(store=str(store), strategy=name, parts_dir=parts,
                        memory_budget=memory_budget if name == "full" else None, progress=False)
    return strategy_class(name).for_config(probe), memory_budget


def _write(out_path: Path, logits: Tensor, emb: Tensor | None, emb_source: str, task: Any, proba: bool, r: int,
           model: str, run_dir: Path, emb_dim: int = 0) -> dict[str, Any]:
    """Write the predictions (or probabilities) and the embeddings (unless already written); return what was."""
    pred, prob = task.predict(logits)
    emb_path = embedding_path(out_path)
    if emb is not None:
        if is_sparse(emb):  # a one-layer model's embeddings are its input rows: bag-of-words rows are sparse
            emb = emb.to_dense()
        _save_npy_atomic(emb_path, emb.float().cpu().numpy())
        emb_dim = int(emb.shape[1])
    try:  # the pair or neither: predictions without their embeddings made a re-run refuse "exists"
        _save_npy_atomic(out_path, (prob.float() if proba else pred).cpu().numpy())
    except BaseException:
        emb_path.unlink(missing_ok=True)
        raise
    return {"predictions": str(out_path), "kind": "probabilities" if proba else task.prediction_kind,
            "task": task.name,
            "embeddings": str(emb_path), "embedding_source": emb_source, "embedding_dim": emb_dim,
            "num_nodes": int(logits.shape[0]), "run": r, "model": model, "run_dir": str(run_dir)}
