"""The package's import structure: no module imports a higher layer, no two modules import each other.

Same rules as ``../shared/tools/layers_check.py``: layers from low to high are :data:`ORDER`; a package not
listed there (``utils``, ``errors``) is the base layer and may import only the base. Module-level and
function-level imports both count (a lazy import is still a dependency). Known violations that other work
is removing are named in :data:`ALLOWED`; an entry that no longer occurs fails the test, so the list only
shrinks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "trellis"
ORDER = ["data", "partition", "ops", "distributed", "plan", "nn", "loader", "train", "cli"]

#: Violations still being fixed elsewhere: ``"upward: a -> b"`` or ``"cycle: a <-> b"`` (sorted members).
#: Empty: ``plan -> nn.decl`` and ``train.pp <-> train.trainer`` were fixed before this test landed.
ALLOWED: set[str] = set()


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                if t.split(".")[0] != "trellis":
                    continue
                r = resolve(t)
                if r and r != mod:
                    edges[mod].add(r)
                if r:
                    break
    return edges


def _layer(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) < 2:
        return -1  # the package's own __init__: its public face, exempt
    return ORDER.index(parts[1]) + 1 if parts[1] in ORDER else 0


def _upward(edges: dict[str, set[str]]) -> set[str]:
    out = set()
    for m, ts in edges.items():
        lm = _layer(m)
        if lm < 0:
            continue
        for t in ts:
            lt = _layer(t)
            same_package = lt > 0 and t.split(".")[1] == m.split(".")[1]
            if lt > lm and not same_package:
                out.add(f"upward: {m} -> {t}")
    return out


def _cycles(edges: dict[str, set[str]], mods: dict[str, Path]) -> set[str]:
    """Strongly connected components of more than one module (Tarjan); a package's __init__ may import its own."""
    graph = {m: {t for t in ts if not (t.startswith(m + ".") and mods[m].name == "__init__.py")}
             for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[str] = set()

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add("cycle: " + " <-> ".join(sorted(comp)))

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def _violations(root: Path = PKG) -> set[str]:
    mods = _modules(root)
    edges = _edges(mods)
    return _upward(edges) | _cycles(edges, mods)


def test_no_upward_imports_and_no_cycles():
    new = _violations() - ALLOWED
    assert not new, "import structure violations (see ../shared/DESIGN.md, layers):\n" + "\n".join(sorted(new))


def test_allow_list_names_only_violations_that_still_occur():
    stale = ALLOWED - _violations()
    assert not stale, "fixed; remove from ALLOWED in tests/test_layering.py:\n" + "\n".join(sorted(stale))


def test_the_checker_sees_function_level_imports_and_cycles(tmp_path):
    pkg = tmp_path / "trellis"
    for sub in ("data", "cli", "utils"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "a.py").write_text("def f():\n    from trellis.cli import b\n")
    (pkg / "cli" / "b.py").write_text("from trellis.data import a\n")
    (pkg / "utils" / "u.py").write_text("from trellis.data.a import f\n")
    assert _violations(pkg) == {"upward: trellis.data.a -> trellis.cli.b", "upward: trellis.utils.u -> trellis.data.a",
                     "cycle: trellis.cli.b <-> trellis.data.a"}
