from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from trellis.errors import TrellisUserError
from trellis.utils.manifest import ManifestFormat, format_of
from trellis.utils.sizes import format_budget, format_size, parse_size


@pytest.mark.parametrize(("text", "want"), [("2G", 2 * 10**9), ("1.5MiB", 3 * 2**19), ("512mib", 512 * 2**20),
                                            (" 4 gb ", 4 * 10**9), ("1000", 1000), (1000, 1000), ("3KiB", 3072)])
def test_parse_size(text, want):
    assert parse_size(text) == want


def test_bare_numbers_take_the_given_unit_and_bad_sizes_name_the_flag():
    assert parse_size("100", bare_unit="MiB") == 100 * 2**20
    assert parse_size("1G", bare_unit="MiB") == 10**9
    assert parse_size(2.5, bare_unit="MiB") == int(2.5 * 2**20)
    with pytest.raises(TrellisUserError, match="--memory-budget: cannot read the size 'lots'"):
        parse_size("lots", flag="--memory-budget")
    with pytest.raises(TrellisUserError):
        parse_size("-1G")
    with pytest.raises(TrellisUserError, match="--memory-budget: '1.5' is a fraction of a byte; give a unit"):
        parse_size("1.5", flag="--memory-budget")  # was 1 byte
    assert parse_size("1.5", bare_unit="MiB") == int(1.5 * 2**20) and parse_size("1.5K") == 1500


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(1536, digits=1) == "1.5 KiB"
    assert format_size(3 * 2**30) == "3.00 GiB"
    assert format_size(2**29, unit="GiB") == "0.50 GiB"


def test_a_budget_is_named_as_it_was_written():
    """A refusal named `--memory-budget 100M` as "95.37 MiB", which read as if another value had been given."""
    assert format_budget(parse_size("100M")) == "100M (95.37 MiB)"
    assert format_budget(parse_size("2G")) == "2G (1.86 GiB)"
    assert format_budget(parse_size("512MiB")) == "512.00 MiB"
    assert format_budget(parse_size("1.5G")) == "1500M (1.40 GiB)"
    assert format_budget(123_457) == "120.56 KiB"


def test_manifest_round_trip_and_errors(tmp_path):
    fmt = ManifestFormat("trellis-thing", 2, what="a thing", create="create one with `make`", fix="redo it")
    raw = fmt.write(tmp_path, {"n": 3})
    assert list(json.loads(raw)) == ["format", "version", "n"]
    assert raw == json.dumps({"format": "trellis-thing", "version": 2, "n": 3}, indent=2).encode()
    assert fmt.read(tmp_path)["n"] == 3 and fmt.is_one(tmp_path) and format_of(tmp_path / "manifest.json")
    with pytest.raises(TrellisUserError, match=r"not a thing \(no manifest.json\); create one with `make`"):
        fmt.read(tmp_path / "nope")
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(TrellisUserError, match="not valid JSON.*redo it"):
        fmt.read(tmp_path)
    assert not fmt.is_one(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "trellis-thing", "version": 1}))
    with pytest.raises(TrellisUserError, match="v1 is not trellis-thing v2; redo it"):
        fmt.read(tmp_path)


def test_an_artefact_given_in_anothers_place_is_named(tmp_path):
    """A layout passed as STORE was told "format 'trellis-partition' v1 is not trellis-store v1; re-import the
    store", and a layout given as --pp-dir "choose another --out"; each now says what it is and where it goes."""
    from trellis.loader.ppcache import inspect_pp, open_pp
    from trellis.utils.manifest import LAYOUT_FORMAT, PP_FORMAT, STORE_FORMAT

    LAYOUT_FORMAT.write(tmp_path, {})
    with pytest.raises(TrellisUserError, match="this is a partitioned layout, not a Trellis store; pass a layout as "
                                               "--parts-dir PART_DIR"):
        STORE_FORMAT.read(tmp_path)
    assert inspect_pp(tmp_path) == "foreign"
    with pytest.raises(TrellisUserError, match=r"not a pre-propagation cache \(it is a partitioned layout\); give "
                                               "the --pp-dir of a `trellis preprocess` output"):
        open_pp(tmp_path)
    PP_FORMAT.write(tmp_path, {})
    with pytest.raises(TrellisUserError, match="this is a pre-propagation cache, not a partitioned layout; pass a "
                                               "cache as --pp-dir PP_DIR"):
        LAYOUT_FORMAT.read(tmp_path)
    run = tmp_path / "run"  # a run directory (no manifest) given as STORE: "not a Trellis store (no manifest.json)"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(TrellisUserError, match="no manifest.json; it is a run directory of `trellis train`, for "
                                               "`trellis predict` and --resume"):
        STORE_FORMAT.read(run)


ALLOWED_BASE = {"numpy", "torch", "numba", "psutil", "trellis"}


def test_utils_import_only_the_base_layer():
    """``trellis.utils`` sits below ``data``: stdlib, numpy, torch, numba (psutil as a fallback), trellis.errors."""
    root = Path(__file__).resolve().parents[2] / "trellis" / "utils"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ALLOWED_BASE, f"{path.name} imports {name}"
                if top == "trellis":
                    assert name == "trellis.errors" or name.startswith("trellis.utils"), f"{path.name}: {name}"
