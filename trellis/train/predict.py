"""Inference with a trained run: predictions and node embeddings for every node of a store.

``trellis predict RUN_DIR STORE --out FILE.npy`` rebuilds the model from ``RUN_DIR/models/run-<r>.pt``
(the best-validation run by default), applies the same feature normalization the run trained with, and
writes ``FILE.npy`` (class ids, or probabilities with ``--proba``) and ``FILE_emb.npy`` (the input of
the last layer — the node embedding — when the model can return it, else the logits). The store may be
another graph with the same feature width (inductive use).
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.data.store import open_store
from trellis.errors import TrellisUserError
from trellis.train.build import ModelFactory, default_model_factory, make_model
from trellis.train.config import TrainConfig
from trellis.train.data import load_graph_data, resolve_device
from trellis.train.features import NodeEmbedding
from trellis.train.runs import open_run_dir, read_json
from trellis.train.strategies.pp import predict_pp
from trellis.train.tasks import TASKS
from trellis.train.trainer import MODEL_FORMAT
from trellis.utils.atomic import file_mode


def embedding_path(out: Path) -> Path:
    """``preds.npy`` -> ``preds_emb.npy``."""
    return out.with_name(out.stem + "_emb.npy")


def _accepts_return_embedding(model: nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "return_embedding" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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
    """The run whose weights predict uses: ``run`` if given, else the summary's best-validation run."""
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
def predict(run_dir: str | os.PathLike[str], store: str | os.PathLike[str], out: str | os.PathLike[str], *,
            run: int | None = None, proba: bool = False, device: str = "auto",
            model_factory: ModelFactory | None = None, memory_budget: str | None = None,
            spill_dir: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write predictions and embeddings of every node of ``store``.

    Args:
        run_dir: A ``trellis train`` run directory.
        store: Graph store to predict on (features of the same width as in training).
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
    if not overwrite:
        for existing in (out_path, embedding_path(out_path)):
            if existing.exists():
                raise TrellisUserError(f"--out {out_path}: {existing} exists; choose another --out or pass --overwrite")
    saved = torch.load(open_run_dir(run_dir).model(r), map_location="cpu", weights_only=True)
    if saved.get("strategy") == "pp" or saved.get("format") == "trellis-pp-model":
        record = {**saved, "out_dim": saved.get("out_dim", saved.get("num_classes"))}  # older pp model files
        pp_logits = predict_pp(record, open_store(store), resolve_device(device))
        pp_task = TASKS[saved.get("task", "multiclass")](record["out_dim"])
        return _write(out_path, pp_logits, pp_logits, "logits", pp_task, proba, r, saved["model"], run_dir)
    if saved.get("format") != MODEL_FORMAT:
        raise TrellisUserError(f"{run_dir}: models/run-{r}.pt is not a trellis model file")
    run_cfg = read_json(open_run_dir(run_dir).config)
    if run_cfg.get("parts_dir") and run_cfg.get("strategy") in ("mini", "cluster"):
        return _predict_buffered(saved, run_dir, run_cfg, store, out_path, r, proba,
                                 memory_budget or run_cfg.get("memory_budget"), spill_dir, model_factory)
    if memory_budget is None and run_cfg.get("strategy", "full") == "full":
        memory_budget = run_cfg.get("memory_budget")
    if memory_budget is not None:
        return _predict_out_of_core(saved, run_dir, run_cfg, store, out_path, r, proba, memory_budget,
                                    spill_dir or run_cfg.get("spill_dir"), model_factory)
    dev = resolve_device(device)
    features = saved.get("features", "store")
    data = load_graph_data(store, device=dev, feature_norm=saved["feature_norm"], need_labels=False,
                           features=features)
    if data.embedding_dim and data.store.num_nodes != saved["num_nodes"]:
        raise TrellisUserError(f"{store}: has {data.store.num_nodes} nodes but the run learned an embedding table "
                               f"of {saved['num_nodes']} (--features {features}); predict on the training graph")
    if data.in_dim != saved["in_dim"]:
        raise TrellisUserError(f"{store}: features have width {data.in_dim} but the model was trained on width "
                               f"{saved['in_dim']}; predict on a store with the same features")
    model = make_model(model_factory or default_model_factory, saved["model"], saved["in_dim"], saved["out_dim"],
                       edge_dim=saved["edge_dim"],
                       **saved["kwargs"])
    if data.embedding_dim:
        model = NodeEmbedding(model, data.store.num_nodes, data.embedding_dim)
    model.load_state_dict(saved["state_dict"])
    model.to(dev).eval()
    task = TASKS[saved["task"]](saved["out_dim"])
    logits: Tensor = model(data.graph, data.x)
    emb: Tensor = logits
    emb_source = "logits"
    if _accepts_return_embedding(getattr(model, "model", model)):  # a NodeEmbedding passes it to its model
        res = model(data.graph, data.x, return_embedding=True)
        emb = res[1] if isinstance(res, tuple) else res
        emb_source = "penultimate"
    return _write(out_path, logits, emb, emb_source, task, proba, r, saved["model"], run_dir)


def _predict_out_of_core(saved: dict[str, Any], run_dir: Path, run_cfg: dict[str, Any],
                         store: str | os.PathLike[str], out_path: Path, r: int, proba: bool, memory_budget: str,
                         spill_dir: str | None, model_factory: ModelFactory | None) -> dict[str, Any]:
    """``predict`` by tiled inference under ``memory_budget`` (see :func:`predict`)."""
    from trellis.train.strategies.outofcore import predict_out_of_core

    if saved.get("features", "store") not in ("store", "none", "degree"):
        raise TrellisUserError(f"--memory-budget: a model trained with --features {saved['features']} predicts in "
                               "memory only; drop --memory-budget")
    cfg = TrainConfig(store=str(store), model=saved["model"], device="cpu", memory_budget=memory_budget,
                      spill_dir=spill_dir or str(run_dir / "spill"), feature_norm=saved["feature_norm"],
                      features=saved.get("features", "store"), progress=False)
    model = make_model(model_factory or default_model_factory, saved["model"], saved["in_dim"], saved["out_dim"],
                       edge_dim=saved["edge_dim"], **saved["kwargs"])
    model.load_state_dict(saved["state_dict"])
    model.eval()
    task = TASKS[saved["task"]](saved["out_dim"])
    emb_path = embedding_path(out_path)
    logits, emb_dim = predict_out_of_core(cfg, model, task, emb_path)
    source = "penultimate" if len(getattr(model, "convs", ())) > 1 else "features"
    return _write(out_path, logits, None, source, task, proba, r, saved["model"], run_dir, emb_dim=emb_dim)


def _predict_buffered(saved: dict[str, Any], run_dir: Path, run_cfg: dict[str, Any], store: str | os.PathLike[str],
                      out_path: Path, r: int, proba: bool, memory_budget: str | None, spill_dir: str | None,
                      model_factory: ModelFactory | None) -> dict[str, Any]:
    """``predict`` for a run trained through a partition buffer: its strategy's inference over the same layout.

    Layer-wise over the buffer within ``memory_budget`` (default: the run's own), exact without one; the
    features are read from the layout (the store may hold none after ``trellis partition --move-features``).
    """
    from trellis.train.strategies import strategy_class

    keep = {k: run_cfg[k] for k in ("strategy", "model", "parts_dir", "buffer_parts", "buffer_cache", "fanouts",
                                    "batch_size", "layers", "hidden", "task", "split_seed", "labor")
            if run_cfg.get(k) is not None}
    cfg = TrainConfig.from_dict({**keep, "store": str(store), "nproc": 1, "device": "cpu", "progress": False,
                                 "feature_norm": saved["feature_norm"], "memory_budget": memory_budget,
                                 "spill_dir": spill_dir})
    strategy = strategy_class(cfg.strategy).for_config(cfg)(cfg, torch.device("cpu"))
    strategy.load()
    try:
        model = make_model(model_factory or default_model_factory, saved["model"], saved["in_dim"],
                           saved["out_dim"], edge_dim=saved["edge_dim"], **saved["kwargs"])
        model.load_state_dict(saved["state_dict"])
        logits = strategy.predict(model)
    finally:
        strategy.close()
    task = TASKS[saved["task"]](saved["out_dim"])
    return _write(out_path, logits, logits, "logits", task, proba, r, saved["model"], run_dir)


def _write(out_path: Path, logits: Tensor, emb: Tensor | None, emb_source: str, task: Any, proba: bool, r: int,
           model: str, run_dir: Path, emb_dim: int = 0) -> dict[str, Any]:
    """Write the predictions (or probabilities) and the embeddings (unless already written); return what was."""
    pred, prob = task.predict(logits)
    _save_npy_atomic(out_path, (prob.float() if proba else pred).cpu().numpy())
    emb_path = embedding_path(out_path)
    if emb is not None:
        _save_npy_atomic(emb_path, emb.float().cpu().numpy())
        emb_dim = int(emb.shape[1])
    return {"predictions": str(out_path), "kind": "probabilities" if proba else task.prediction_kind,
            "task": task.name,
            "embeddings": str(emb_path), "embedding_source": emb_source, "embedding_dim": emb_dim,
            "num_nodes": int(logits.shape[0]), "run": r, "model": model, "run_dir": str(run_dir)}
