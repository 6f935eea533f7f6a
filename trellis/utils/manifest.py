"""``manifest.json``: the metadata file that describes every on-disk artefact (store, layout, pp cache).

Why one base: each artefact names its format and version in the manifest, and each opened it with its
own copy of the same checks. :class:`ManifestFormat` writes the manifest (``format`` and ``version``
first, then the artefact's fields, JSON indented by two) and reads it back with one set of clear errors:
no manifest, invalid JSON, another format or version, each naming the path and the command that fixes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, overload

from trellis.errors import TrellisUserError
from trellis.utils.atomic import MANIFEST

__all__ = ["KNOWN_FORMATS", "LAYOUT_FORMAT", "MANIFEST", "PP_FORMAT", "STORE_FORMAT", "ManifestField",
           "ManifestFormat", "format_of", "what_it_is"]

T = TypeVar("T")



class _HasManifest(Protocol):
    manifest: dict[str, Any]


def format_of(path: str | os.PathLike[str]) -> str | None:
    """The ``format`` field of the JSON file ``path``, or None when it is missing, unreadable or has none."""
    try:
        value = json.loads(Path(path).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ManifestFormat:
    """A kind of artefact directory: its format name, version and how to talk about it in errors.

    Attributes:
        name: Format name recorded in the manifest (``trellis-store``).
        version: Format version this code reads and writes.
        what: The artefact for messages, with its article (``a Trellis store``).
        create: How to create one (``create one with `trellis data import```).
        fix: What to do when it is damaged or of another version (``re-import the store``).
    """

    name: str
    version: int
    what: str
    create: str
    fix: str
    #: How a command takes this artefact (``pass it as STORE``), for a message about it given in another's place.
    given_as: str = ""

    def manifest(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The manifest dict: ``format`` and ``version`` first, then ``fields``."""
        return {"format": self.name, "version": self.version, **fields}

    def write(self, directory: str | os.PathLike[str], fields: dict[str, Any]) -> bytes:
        """Write ``directory/manifest.json`` and return its bytes (callers may hash them).

        The directory is a temporary one that is renamed into place afterwards, so a plain write suffices.
        """
        raw = json.dumps(self.manifest(fields), indent=2).encode()
        (Path(directory) / MANIFEST).write_bytes(raw)
        return raw

    def is_one(self, directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` holds a manifest of this format (any version): an artefact of this kind."""
        return format_of(Path(directory) / MANIFEST) == self.name

    def read(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Parse and check ``directory/manifest.json``.

        Raises:
            TrellisUserError: No manifest, invalid JSON, or another format or version.
        """
        path = Path(directory)
        mpath = path / MANIFEST
        if not mpath.is_file():
            kind = _output_kind(path)
            raise TrellisUserError(f"{path}: not {self.what} (no {MANIFEST}"
                                   + (f"; it is {kind}" if kind else "") + f"); {self.create}")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as exc:
            raise TrellisUserError(f"{mpath}: manifest is not valid JSON ({exc}); {self.fix}") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != self.name \
                or manifest.get("version") != self.version:
            got = manifest if not isinstance(manifest, dict) else manifest.get("format")
            ver = None if not isinstance(manifest, dict) else manifest.get("version")
            other = KNOWN_FORMATS.get(got) if isinstance(got, str) and got != self.name else None
            if other is not None:  # a layout or pp cache where a store goes: "re-import the store" misled
                raise TrellisUserError(f"{path}: this is {other.what}, not {self.what}"
                                       + (f"; {other.given_as}" if other.given_as else "") + f" ({self.create})")
            raise TrellisUserError(f"{mpath}: format {got!r} v{ver} is not {self.name} v{self.version}; {self.fix}")
        return manifest


class ManifestField(Generic[T]):
    """A read-only attribute of an opened artefact: ``kind(self.manifest[key][key2]...)``.

    Why: the store, the partition layout and the pp cache each exposed their manifest entries as
    four-line properties that differed only in key, type and docstring; one line each now says all three::

        num_nodes = ManifestField(int, "num_nodes", doc="Number of nodes ``N``.")

    Args:
        kind: Converts the stored JSON value (``int``, ``str``, ``bool``, ``np.dtype``).
        *keys: The path to the value inside the manifest.
        doc: The attribute's docstring.
    """

    def __init__(self, kind: Callable[[Any], T], *keys: str, doc: str) -> None:
        self.kind = kind
        self.keys = keys
        self.__doc__ = doc

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> ManifestField[T]: ...

    @overload
    def __get__(self, obj: _HasManifest, owner: type | None = None) -> T: ...

    def __get__(self, obj: _HasManifest | None, owner: type | None = None) -> T | ManifestField[T]:
        if obj is None:
            return self
        value: Any = obj.manifest
        for key in self.keys:
            value = value[key]
        return self.kind(value)


#: The three artefacts, defined here together so that each can name the others when one is given in another's
#: place (a layout passed as STORE was told to "re-import the store").
STORE_FORMAT = ManifestFormat(
    "trellis-store", 1, what="a Trellis store",
    create="create one with `trellis data import` or `trellis data generate`", fix="re-import the store",
    given_as="pass a store as STORE")
LAYOUT_FORMAT = ManifestFormat(
    "trellis-partition", 1, what="a partitioned layout", create="create one with `trellis partition`",
    fix="re-run `trellis partition`",
    given_as="pass a layout as --parts-dir PART_DIR, beside the store it was made from")
PP_FORMAT = ManifestFormat(
    "trellis-ppcache", 1, what="a pre-propagation cache",
    create="create it with `trellis preprocess STORE --out DIR`", fix="run `trellis preprocess` again",
    given_as="pass a cache as --pp-dir PP_DIR, beside the store it was made from")
#: Every artefact format by name.
KNOWN_FORMATS = {f.name: f for f in (STORE_FORMAT, LAYOUT_FORMAT, PP_FORMAT)}


def _output_kind(path: Path) -> str:
    """What a command's output directory without a manifest is (a run, a sweep, a tune), or ``""``."""
    if (path / "tune.json").is_file():
        return "the output of `trellis tune`"
    if (path / "sweep.json").is_file():
        return "the output of `trellis sweep`"
    if (path / "config.json").is_file() and (path / "metrics.jsonl").is_file():
        return "a run directory of `trellis train`, for `trellis predict` and --resume"
    return ""


def what_it_is(path: str | os.PathLike[str]) -> str:
    """``" (it is a partitioned layout)"`` when the directory ``path`` is a Trellis artefact, else ``""``."""
    other = KNOWN_FORMATS.get(format_of(Path(path) / MANIFEST) or "")
    return f" (it is {other.what})" if other is not None else ""
