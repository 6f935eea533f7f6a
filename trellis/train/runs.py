"""Run directories: layout, atomic writes, the per-epoch metrics log and the curves plot.

Layout of a run directory (``trellis train --out RUN_DIR``)::

    RUN_DIR/
      config.json          the resolved TrainConfig (``--config RUN_DIR/config.json`` repeats the run)
      metrics.jsonl        one line per epoch per run: run, seed, epoch, loss, <split>_<metric>, times
      summary.json         results over all runs (written last; its presence means the run completed)
      checkpoints/last.pt  model, optimizer, early-stopping state and RNG states (rolling, atomic)
      models/run-<r>.pt    best-validation weights of run r, with what is needed to rebuild the model
      curves.svg           loss and validation/test metric per epoch (opens in any browser)

Why atomic writes: a run can be killed at any instant (that is what checkpoints are for); a JSON file or
checkpoint is written to a temporary sibling and renamed over the old one, so a reader always sees
either the old or the new complete file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from trellis.errors import TrellisUserError
from trellis.utils.atomic import json_default, write_text_atomic
from trellis.utils.atomic import torch_save_atomic as torch_save_atomic  # re-exported: callers import it from here
from trellis.utils.atomic import write_json_atomic as write_json_atomic  # re-exported
from trellis.utils.manifest import what_it_is
from trellis.utils.svgplot import COLORS, Panel, Series, line_chart


class _RunPath:
    """A path inside the run directory, read as an attribute of :class:`RunPaths`: ``root / parts``."""

    def __init__(self, *parts: str, doc: str) -> None:
        self.parts = parts
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _RunPath: ...

    @overload
    def __get__(self, obj: RunPaths, owner: type | None = None) -> Path: ...

    def __get__(self, obj: RunPaths | None, owner: type | None = None) -> Path | _RunPath:
        return self if obj is None else obj.root.joinpath(*self.parts)


@dataclass(frozen=True)
class RunPaths:
    """The files of one run directory."""

    root: Path

    config = _RunPath("config.json", doc="``config.json``: the resolved configuration (``--resume`` and "
                                         "``--config`` read it back).")
    metrics = _RunPath("metrics.jsonl", doc="``metrics.jsonl``: one record per evaluated epoch and run.")
    summary = _RunPath("summary.json", doc="``summary.json``: the final metrics over all runs.")
    checkpoints = _RunPath("checkpoints", doc="``checkpoints/``: the directory of resume checkpoints.")
    checkpoint = _RunPath("checkpoints", "last.pt", doc="``checkpoints/last.pt``: the latest checkpoint, the one "
                                                        "``--resume`` continues from.")
    models = _RunPath("models", doc="``models/``: the directory of per-run best-validation weights.")
    curves = _RunPath("curves.svg", doc="``curves.svg``: loss and metric curves per epoch.")

    def model(self, run: int) -> Path:
        """``models/run-<run>.pt``: best-validation weights of run ``run`` (``trellis predict`` loads them)."""
        return self.models / f"run-{run}.pt"


#: The launch's id in its ranks' environment: a peer rank's scratch directory is ``<tmp>/PEER_PREFIX<id>-*``,
#: which the launcher removes when the job ends (a peer killed with ``kill -9`` cannot).
JOB_ENV = "TRELLIS_JOB"
PEER_PREFIX = "trellis-peer-"


def default_run_dir(store_name: str, model: str) -> Path:
    """``runs/<store>-<model>-<YYYYmmdd-HHMMSS>`` under the working directory."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in store_name) or "graph"
    base = Path("runs") / f"{safe}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():  # two runs started in the same second get distinct directories
        path, k = base.with_name(f"{base.name}-{k}"), k + 1
    return path


#: What a run directory holds (``spill/``: out-of-core spill files under the run's default spill root).
#: The lock file of a run directory being written (:class:`RunLock`).
LOCK_FILE = ".lock"

_RUN_ENTRIES = frozenset({"config.json", "metrics.jsonl", "summary.json", "checkpoints", "models", "curves.svg",
                          "spill", LOCK_FILE})


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock`` while a process writes the run directory.

    Why: two writers of one directory mixed two runs (a second ``--resume`` logged every epoch twice; ``--overwrite``
    of a running run left one run's summary beside the other's config). The kernel drops the lock when its process
    dies, so a killed run never leaves the directory locked.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock (creating the directory); refuse with a user error when another process holds it."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise TrellisUserError(f"{self.root}: another trellis process is writing this run directory; wait for it "
                                   "to finish, or choose another --out") from None
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: removing it could race a process that just opened it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def prepare_run_dir(path: str | os.PathLike[str], *, overwrite: bool = False) -> RunPaths:
    """Create a fresh run directory (and ``checkpoints/``, ``models/``).

    Raises:
        TrellisUserError: ``path`` exists and is not empty, unless ``overwrite``.
    """
    root = Path(path)
    check_run_dir(root, overwrite=overwrite)
    if root.is_dir() and overwrite:
        for p in (RunPaths(root).summary, RunPaths(root).metrics, RunPaths(root).checkpoint, RunPaths(root).curves):
            p.unlink(missing_ok=True)
        for p in RunPaths(root).models.glob("run-*.pt"):
            p.unlink()
    paths = RunPaths(root)
    paths.checkpoints.mkdir(parents=True, exist_ok=True)
    paths.models.mkdir(parents=True, exist_ok=True)
    return paths


def check_run_dir(root: Path, *, overwrite: bool = False) -> None:
    """Refuse a ``--out`` that :func:`prepare_run_dir` would refuse, writing nothing (a launcher's preflight).

    Raises:
        TrellisUserError: ``root`` is a file, holds files that are not a run's, or is a run without ``overwrite``.
    """
    if root.exists() and not root.is_dir():
        raise TrellisUserError(f"--out {root}: exists and is not a directory; choose another --out")
    if root.is_dir() and any(p.name != LOCK_FILE for p in root.iterdir()):
        foreign = sorted(p.name for p in root.iterdir() if p.name not in _RUN_ENTRIES)
        if foreign and not RunPaths(root).config.is_file():  # --overwrite would write beside the user's files
            raise TrellisUserError(f"--out {root}: exists and holds files that are not a run's ({foreign[0]}, ...); "
                                   "choose a new or empty --out")
        if not overwrite:
            raise TrellisUserError(
                f"--out {root}: run directory already exists; choose another --out, continue it with "
                f"`trellis train --resume {root}`, or pass --overwrite")


def sweep_dir_error(path: Path, resume: bool = False) -> TrellisUserError | None:
    """The error for a sweep's or a tune's directory given where a run directory goes (naming its runs), else None."""
    if (path / "tune.json").is_file():
        if resume:
            return TrellisUserError(f"{path}: a tune directory, not a run directory; continue an interrupted tune "
                                    f"with `trellis tune --resume {path}`")
        return TrellisUserError(f"{path}: a tune directory, not a run directory; the chosen configuration's runs are "
                                f"its final/configs/<run>/ directories ({path / 'final' / 'configs'}): pass those")
    if (path / "leaderboard.json").is_file() or (path / "configs").is_dir():
        return TrellisUserError(f"{path}: a sweep directory, not a run directory; pass its configs/<id>/ directories")
    return None


def open_run_dir(path: str | os.PathLike[str], resume: bool = False) -> RunPaths:
    """An existing run directory (for ``--resume``, which says so, and ``trellis predict``)."""
    paths = RunPaths(Path(path))
    if not paths.config.is_file():
        if (err := sweep_dir_error(paths.root, resume)) is not None:
            raise err
        raise TrellisUserError(f"{paths.root}: not a run directory (no config.json){what_it_is(paths.root)}; pass "
                               "the --out of a `trellis train` run")
    return paths


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse the JSON file at ``path``; an unreadable or malformed file is a :class:`TrellisUserError`."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TrellisUserError(f"{p}: unreadable ({exc})") from exc


def json_line(obj: dict[str, Any]) -> str:
    """One compact JSON line; NaN and Inf become ``null`` so every line is strict JSON."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in obj.items()}
    return json.dumps(clean, default=json_default, separators=(",", ":"))


class MetricsLog:
    """Append-only JSONL log whose byte offset is recorded in checkpoints.

    On resume the file is truncated back to the offset of the checkpoint, so the epochs that ran after
    it (and are run again) are not logged twice.
    """

    def __init__(self, path: Path, *, offset: int | None = None) -> None:
        self.path = path
        if offset is not None and path.exists():
            with open(path, "r+b") as f:
                f.truncate(offset)
        self._f = open(path, "ab")

    @property
    def offset(self) -> int:
        """Bytes written so far: the offset a checkpoint records so a resume truncates back to it."""
        return self._f.tell()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line and flush, so a killed run loses no logged epoch."""
        self._f.write((json_line(record) + "\n").encode())
        self._f.flush()

    def close(self) -> None:
        """Close the file."""
        self._f.close()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSONL file."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSONL file lazily, skipping blank lines."""
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def plot_curves(metrics_path: Path, out: Path, metric: str) -> None:
    """Draw training loss and validation/test ``metric`` per epoch, one colour per run, to ``out`` (SVG).

    SVG text instead of a matplotlib PNG: drawing this took about 0.9 s of every run (mostly importing pyplot),
    now about 10 ms (``trellis.utils.svgplot``; `python -m benchmarks.bench_startup --only curves`).
    """
    by_run: dict[int, list[dict[str, Any]]] = {}
    for rec in iter_jsonl(metrics_path):
        by_run.setdefault(int(rec["run"]), []).append(rec)
    loss = Panel(title="loss", xlabel="epoch", ylabel="training loss", legend=len(by_run) <= 5)
    scores = Panel(title=f"{metric} (solid: val, dashed: test)", xlabel="epoch", ylabel=metric,
                   legend=len(by_run) <= 5)
    for i, (run, recs) in enumerate(sorted(by_run.items())):
        color = COLORS[i % len(COLORS)]
        loss.series.append(Series([r["epoch"] for r in recs], [r["loss"] for r in recs], f"run {run}", color))
        evaluated = [r for r in recs if r.get(f"val_{metric}") is not None]  # every epoch, or --eval-every's
        at = [r["epoch"] for r in evaluated]
        scores.series.append(Series(at, [r[f"val_{metric}"] for r in evaluated], f"val, run {run}", color))
        scores.series.append(Series(at, [r.get(f"test_{metric}") for r in evaluated], f"test, run {run}", color,
                                    dashed=True))
    write_text_atomic(out, line_chart([loss, scores]))
