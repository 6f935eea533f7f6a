"""Chunked readers for text tables and edge lists (plain or ``.gz``), with line-exact error messages.

A file is read in blocks of whole lines (``block_bytes`` at a time) and each block is parsed by
``numpy.loadtxt`` (C speed, about 10 M lines/s). Only when a block fails to parse is it scanned again
line by line, to name the exact line and the fix. ``#`` starts a comment; blank lines are skipped;
columns are separated by commas, tabs or spaces (detected from the first data line).
"""

from __future__ import annotations

import gzip
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from trellis.data.csr import DEFAULT_CHUNK_EDGES, EdgeChunk, as_node_ids, check_inferred_count
from trellis.errors import TrellisUserError

#: Bytes per block when reading text: about 2-4 M edge lines.
DEFAULT_BLOCK_BYTES = 32 * 1024 * 1024
COMMENT = "#"


#: The byte-order mark some editors write at the start of a UTF-8 text file; not part of the first value.
UTF8_BOM = b"\xef\xbb\xbf"


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for binary reading, decompressing ``.gz`` transparently."""
    path = Path(path)
    if not path.is_file():
        raise TrellisUserError(f"{path}: file not found; check the path")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def iter_blocks(path: str | os.PathLike[str], block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block, first_line)``: blocks of whole lines and the 1-based number of their first line."""
    block_bytes = max(1, int(block_bytes))
    line = 1
    rest = b""
    with open_binary(path) as f:
        while True:
            try:
                data = f.read(block_bytes)
            except (OSError, EOFError) as exc:
                raise TrellisUserError(f"{path}: cannot be read ({exc}); the file is damaged or truncated") from exc
            if not data:
                if rest:
                    yield rest, line
                return
            buf = rest + data
            if line == 1 and buf.startswith(UTF8_BOM):  # Excel's and Notepad's "UTF-8" CSVs start with one
                buf = buf[len(UTF8_BOM):]
            cut = buf.rfind(b"\n")
            if cut < 0:
                rest = buf
                continue
            block, rest = buf[: cut + 1], buf[cut + 1:]
            yield block, line
            line += block.count(b"\n")


def _data_lines(block: bytes, first_line: int) -> Iterator[tuple[int, str]]:
    """Non-blank, comment-stripped lines of ``block`` with their line numbers (slow path, errors only)."""
    for i, raw in enumerate(block.decode("utf-8", errors="replace").splitlines()):
        text = raw.split(COMMENT, 1)[0].strip()
        if text:
            yield first_line + i, text


def _split(text: str, delimiter: str | None) -> list[str]:
    return [t.strip() for t in text.split(delimiter)] if delimiter else text.split()


def detect_delimiter(path: str | os.PathLike[str]) -> str | None:
    """``","`` when the first data line has a comma, else None (any whitespace, tabs included)."""
    for block, first in iter_blocks(path, 64 * 1024):
        for _, text in _data_lines(block, first):
            return "," if "," in text else None
    return None


def _describe_bad_line(path: Path, block: bytes, first_line: int, delimiter: str | None, ncols: int | None,
                       integer: bool, what: str) -> str:
    """Find the first line that does not parse and say what is wrong with it and how to fix it."""
    kind = "integer" if integer else "number"
    for lineno, text in _data_lines(block, first_line):
        tokens = _split(text, delimiter)
        ncols = len(tokens) if ncols is None else ncols  # without a required width, the first line sets it
        if ncols is not None and len(tokens) != ncols:
            return (f"{path}: line {lineno}: expected {ncols} column{'s' if ncols > 1 else ''} ({what}) but found "
                    f"{len(tokens)} in {text!r}; fix the line or comment it out with #")
        for tok in tokens:
            try:
                value = int(tok) if integer else float(tok)
            except ValueError:
                return (f"{path}: line {lineno}: {tok!r} is not an {kind} in {text!r} ({what}); "
                        "fix the value, or comment the line out with # if it is a header")
            if integer and not -2**63 <= value < 2**63:
                return f"{path}: line {lineno}: {tok!r} does not fit in 64 bits in {text!r} ({what}); fix the value"
    return f"{path}: lines {first_line}+ could not be parsed as {what}; check the delimiter and column count"


def line_of_row(block: bytes, first_line: int, row: int) -> int:
    """Line number of data row ``row`` (0-based, comments and blank lines skipped) within ``block``."""
    for i, (lineno, _) in enumerate(_data_lines(block, first_line)):
        if i == row:
            return lineno
    return first_line


def parse_block(path: Path, block: bytes, first_line: int, *, dtype: type, ncols: int | None,
                delimiter: str | None, what: str) -> np.ndarray:
    """Parse one block into a ``[rows, ncols]`` array; a bad line raises :class:`TrellisUserError`."""
    integer = np.issubdtype(dtype, np.integer)
    text = io.StringIO(block.decode("utf-8", errors="replace"), newline=None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data" for comment-only blocks
            arr: np.ndarray = np.loadtxt(text, dtype=dtype, comments=COMMENT, delimiter=delimiter, ndmin=2)
    except ValueError:
        raise TrellisUserError(
            _describe_bad_line(path, block, first_line, delimiter, ncols, integer, what)) from None
    if arr.size == 0:
        return np.zeros((0, ncols or 0), dtype=dtype)
    if ncols is not None and arr.shape[1] != ncols:
        raise TrellisUserError(_describe_bad_line(path, block, first_line, delimiter, ncols, integer, what))
    return arr


def read_table(path: str | os.PathLike[str], *, dtype: type = np.float32, ncols: int | None = None,
               what: str = "values", block_bytes: int = DEFAULT_BLOCK_BYTES) -> np.ndarray:
    """Read a whole delimited text table (``.gz`` allowed) into a ``[rows, cols]`` array.

    Args:
        path: The file.
        dtype: Element type; integer dtypes refuse fractions with the line number.
        ncols: Required column count (default: that of the first data line, then held fixed).
        what: What a row holds, for error messages (default: ``"values"``).
        block_bytes: Bytes per parsed block.
    """
    path = Path(path)
    delimiter = detect_delimiter(path)
    parts = []
    for block, first in iter_blocks(path, block_bytes):
        arr = parse_block(path, block, first, dtype=dtype, ncols=ncols, delimiter=delimiter, what=what)
        if arr.shape[0]:
            ncols = arr.shape[1]
            parts.append(arr)
    if not parts:
        return np.zeros((0, ncols or 0), dtype=dtype)
    return np.concatenate(parts)


class TextEdgeSource:
    """Edges from a text file of ``src dst`` lines (comma, tab or space separated; ``#`` comments; ``.gz``).

    Each chunk is validated: a non-integer, negative or too-large id raises :class:`TrellisUserError`
    naming the file and line.
    """

    def __init__(self, path: str | os.PathLike[str], *, chunk_edges: int = DEFAULT_CHUNK_EDGES,
                 delimiter: str | None | bool = True) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        if not self.path.is_file():
            raise TrellisUserError(f"{self.path}: file not found; check the path")
        self.block_bytes = max(16, int(chunk_edges) * 16)
        self.delimiter = detect_delimiter(self.path) if delimiter is True else delimiter

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes; importers stream the build above a size threshold."""
        return self.path.stat().st_size

    def chunks(self, num_nodes: int | None = None) -> Iterator[EdgeChunk]:
        """Yield validated edge chunks parsed block by block, so memory stays bounded for any file size."""
        start = 0
        for block, first in iter_blocks(self.path, self.block_bytes):
            arr = parse_block(self.path, block, first, dtype=np.int64, ncols=2, delimiter=self.delimiter,  # type: ignore[arg-type]
                              what="two integer node ids 'src dst'")
            if arr.shape[0] == 0:
                continue
            self._check(arr, block, first, num_nodes)
            yield EdgeChunk(np.ascontiguousarray(arr[:, 0]), np.ascontiguousarray(arr[:, 1]), start)
            start += arr.shape[0]

    def _check(self, arr: np.ndarray, block: bytes, first: int, num_nodes: int | None) -> None:
        bad = np.flatnonzero((arr < 0).any(axis=1))
        if bad.size:
            line = line_of_row(block, first, int(bad[0]))
            raise TrellisUserError(f"{self.path}: line {line}: negative node id in {arr[bad[0]].tolist()}; "
                                   "node ids must be 0..N-1")
        if num_nodes is None:
            top = int(arr.max())
            row = int(np.argmax(arr.max(axis=1) == top))
            check_inferred_count(top, f"{self.path}: line {line_of_row(block, first, row)}")
        else:
            bad = np.flatnonzero((arr >= num_nodes).any(axis=1))
            if bad.size:
                line = line_of_row(block, first, int(bad[0]))
                raise TrellisUserError(
                    f"{self.path}: line {line}: node id {int(arr[bad[0]].max())} but the graph has {num_nodes} "
                    f"nodes (ids 0..{num_nodes - 1}); renumber the nodes or give the right node count")


class NpyEdgeSource:
    """Edges from an ``[E, 2]`` ``.npy`` file, memory-mapped and read in chunks."""

    def __init__(self, path: str | os.PathLike[str], *, chunk_edges: int = DEFAULT_CHUNK_EDGES) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self.chunk_edges = max(1, int(chunk_edges))
        self.array = load_npy(self.path)
        shape = self.array.shape
        if self.array.ndim != 2 or shape[1] != 2:
            hint = " (that looks like PyG's edge_index: save edge_index.T)" if self.array.ndim == 2 and shape[0] == 2 \
                else ""
            raise TrellisUserError(f"{self.path}: edges must have shape [E, 2] (src, dst) but have {shape}{hint}")

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes; importers stream the build above a size threshold."""
        return self.path.stat().st_size

    def chunks(self, num_nodes: int | None = None) -> Iterator[EdgeChunk]:
        """Yield ``chunk_edges`` rows at a time from the memory map as validated int64 ``src``/``dst`` chunks."""
        for start in range(0, self.array.shape[0], self.chunk_edges):
            block = np.asarray(self.array[start:start + self.chunk_edges])
            src = as_node_ids(block[:, 0], f"{self.path} (column 0)", num_nodes, row_offset=start)
            dst = as_node_ids(block[:, 1], f"{self.path} (column 1)", num_nodes, row_offset=start)
            yield EdgeChunk(np.ascontiguousarray(src), np.ascontiguousarray(dst), start)


def load_npy(path: str | os.PathLike[str], *, mmap: bool = True) -> np.ndarray:
    """Load a ``.npy`` file (memory-mapped by default); a missing or unreadable file is a user error."""
    path = Path(path)
    if not path.is_file():
        raise TrellisUserError(f"{path}: file not found; check the path")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise TrellisUserError(f"{path}: not a readable .npy array ({exc}); save it with numpy.save") from exc
    if not isinstance(arr, np.ndarray):
        raise TrellisUserError(f"{path}: not a .npy array; save it with numpy.save")
    return arr
