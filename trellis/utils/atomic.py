"""Atomic writes: a file is replaced whole or not at all, an output directory appears whole or not at all.

Why: a run can be killed at any instant, and an interrupted import, partitioning, preprocessing or sweep
must never leave an output that opens. A file is written to a temporary sibling, flushed and renamed
over the old one; a directory is built in a hidden temporary sibling and renamed into place only when
complete (the old one, if any, is moved aside first and deleted after).

And why a guard: ``--overwrite`` deletes the old output, so it is allowed only on a directory that this
kind of command wrote (or an empty one). A mistyped ``--out ~/data --overwrite`` must not delete the
user's files; :func:`check_output` refuses it with exit code 2 and deletes nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import IO, Any

import numpy as np

from trellis.errors import TrellisUserError

__all__ = ["MANIFEST", "atomic_dir", "atomic_write", "check_output", "clean_stale_temps", "file_mode", "json_default",
           "replace_dir", "save_npy_atomic", "temp_sibling", "torch_save_atomic", "write_bytes_atomic",
           "write_json_atomic", "write_text_atomic"]

#: The metadata file of every Trellis artefact directory (store, partition layout, pp cache).
MANIFEST = "manifest.json"


# ---- files ------------------------------------------------------------------------------------------
@cache
def file_mode() -> int:
    """The mode ``open()`` gives a new file under the process's umask (``0o666 & ~umask``; read once)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write(f)`` on a temporary sibling of ``path``, fsync it and rename it over ``path``.

    Args:
        path: The file to (re)place; its parent is created if missing.
        write: Writes the content to the binary file object it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp's 0600 would differ from every file written with open()
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_temps(directory: str | os.PathLike[str]) -> int:
    """Remove the temporary siblings :func:`atomic_write` left in ``directory`` when its process was killed.

    Only for a directory no other process is writing to (a run directory being resumed). Returns how many.
    """
    stale = list(Path(directory).glob(".*.tmp")) if Path(directory).is_dir() else []
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return len(stale)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write(path, lambda f: f.write(data))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes_atomic(path, text.encode())


def json_default(obj: Any) -> Any:
    """``json.dumps`` fallback for numpy scalars and arrays, tensors and paths (everything else: ``str``)."""
    if isinstance(obj, np.generic):
        return obj.item()
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported: not imported here for it
    if isinstance(obj, np.ndarray) or (torch is not None and isinstance(obj, torch.Tensor)):
        return obj.tolist()
    return str(obj)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON (with a final newline) to ``path`` atomically."""
    write_bytes_atomic(path, (json.dumps(obj, indent=2, default=json_default) + "\n").encode())


def torch_save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` atomically (a reader never sees a half-written checkpoint)."""
    import torch

    atomic_write(path, lambda f: torch.save(obj, f))


def save_npy_atomic(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """``np.save(array)`` to ``path`` atomically (the name is kept as given, no ``.npy`` is appended)."""
    atomic_write(path, lambda f: np.save(f, array))


# ---- directories ------------------------------------------------------------------------------------
def _is_store(path: Path) -> bool:
    """A graph store's directory (its manifest says so): what ``--overwrite`` of a store may replace.

    Why not any ``manifest.json``: a pre-propagation cache and a partition layout have one too, and an import or
    ``generate`` with ``--overwrite`` and a mistyped ``--out`` replaced them with a store.
    """
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == "trellis-store"
    except (OSError, ValueError, AttributeError):
        return False


def check_output(out: str | os.PathLike[str], *, overwrite: bool = False,
                 owned: Callable[[Path], bool] | None = None, what: str = "Trellis store") -> None:
    """Refuse an existing ``out`` unless ``overwrite``; even then, never one that is not ours.

    Args:
        out: The output path (``--out``).
        overwrite: Whether ``--overwrite`` was given.
        owned: Whether an existing directory is this command's kind of output and may be replaced
            (default: a graph store's, its manifest's format ``trellis-store``). An empty directory is always
            replaceable.
        what: What ``out`` should be, for the message (default: ``Trellis store``).

    Raises:
        TrellisUserError: ``out`` exists and ``overwrite`` is off, or it is a file, a symlink or a directory
            that ``owned`` does not recognise (nothing is deleted).
    """
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise TrellisUserError(f"{out}: output already exists; choose another --out, remove it, or pass --overwrite")
    is_ours = owned or _is_store
    if out.is_dir() and not out.is_symlink() and (not any(out.iterdir()) or is_ours(out)):
        return
    raise TrellisUserError(f"{out}: exists and is not a {what}; refusing to overwrite it (choose another --out)")


def temp_sibling(out: str | os.PathLike[str], tag: str = "tmp") -> Path:
    """Create and return an empty hidden directory beside ``out`` (same file system, so rename works).

    A plain ``mkdir`` with a unique name rather than ``mkdtemp``: the renamed result keeps the umask's
    mode like any other output directory, not 0700. The name, ``.<out>.<tag>-<pid>-<random>``, holds the
    pid for :func:`clean_stale_temps`, which runs first: a killed writer's sibling (a sweep stopped by SIGTERM, an
    import killed with ``kill -9``) goes when the same output is written again.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out, tag)
    tmp = out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def replace_dir(tmp: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Rename a finished ``tmp`` onto ``out``; an old ``out`` is moved aside first and deleted after.

    Whatever happens in between, ``out`` is either the old or the new complete directory.
    """
    tmp, out = Path(tmp), Path(out)
    if out.exists() or out.is_symlink():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(out, trash)
        os.rename(tmp, out)
        if trash.is_dir() and not trash.is_symlink():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)
    else:
        os.rename(tmp, out)


@contextmanager
def atomic_dir(out: str | os.PathLike[str], *, overwrite: bool = False,
               owned: Callable[[Path], bool] | None = None, what: str = "Trellis store") -> Iterator[Path]:
    """Build a directory in a temporary sibling and rename it onto ``out`` when the block succeeds.

    ``out`` is checked with :func:`check_output` first (same arguments); on any exception the temporary
    directory is removed and ``out`` is left untouched.

    Example::

        with atomic_dir(args.out, overwrite=args.overwrite, owned=is_sweep, what="sweep directory") as tmp:
            write_json_atomic(tmp / "sweep.json", meta)

    Yields:
        The temporary directory to write into.
    """
    check_output(out, overwrite=overwrite, owned=owned, what=what)
    tmp = temp_sibling(out)
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (owners of temporary and spill directories)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(out: str | os.PathLike[str], tag: str = "tmp") -> None:
    """Remove temporary directories of ``out`` (see :func:`temp_sibling`, same ``tag``) whose process is gone."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}.{tag}-"
    for tmp in out.parent.glob(prefix + "*"):
        try:
            pid = int(tmp.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)
