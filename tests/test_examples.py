"""The example notebooks run from a fresh clone: every code cell, in order, in one namespace (no Jupyter needed).

A cell that raises fails the test with the cell's number, so a notebook cannot drift from the API it teaches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("notebook", sorted(EXAMPLES.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(notebook: Path, one_thread, capsys):
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{notebook.name} has no code"
    namespace: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{notebook.name}[cell {i}]", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - reported with the cell
            pytest.fail(f"{notebook.name}, code cell {i} raised {type(exc).__name__}: {exc}\n{source}")
    out = capsys.readouterr().out
    assert "test accuracy" in out and "refused: --lr must be a positive" in out
