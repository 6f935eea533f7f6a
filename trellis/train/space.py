"""Search spaces for ``trellis tune``: what each hyperparameter may take, per model, and how to draw from it.

A space maps a sweepable hyperparameter (:data:`trellis.train.sweep.GRID_KEYS`) to a :class:`Dim`: a list
of choices, or a range drawn uniformly (``uniform``), log-uniformly (``log_uniform``: learning rates and
L2 penalties, whose useful values span decades) or as integers (``int_uniform``). A space file is JSON::

    {"lr": {"log_uniform": [0.001, 0.05]}, "weight_decay": [0, 5e-4, 5e-3],
     "hidden": [64, 128, 256], "dropout": {"uniform": [0.2, 0.8]}}

Why defaults per model (:data:`DEFAULT_SPACES`): a user with a new graph should get the accuracy the graph
supports without knowing which ranges matter. The ranges cover the published settings of each model —
GCN (Kipf & Welling 2017: hidden 16, dropout 0.5, lr 0.01, L2 5e-4), GAT (Veličković et al. 2018: 8 heads
of 8, dropout 0.6, lr 0.005, L2 5e-4), GraphSAGE/GIN (hidden 64-256) — and the per-dataset search of
Shchur et al. 2018 ("Pitfalls of GNN Evaluation": learning rate, L2 strength, dropout and width searched
per dataset, which is how their GCN reached 82.6 on Amazon Computers), widened where our own measurements
on the npz graphs found the optimum at an edge (docs/tune.md).

Drawing is deterministic from the seed: the same space and ``--seed`` give the same candidates.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trellis.errors import TrellisUserError
from trellis.train.sweep import GRID_KEYS, parse_grid_value

#: Range kinds a space file may use for a dimension (besides a plain list of choices).
RANGE_KINDS = ("uniform", "log_uniform", "int_uniform")


@dataclass(frozen=True)
class Dim:
    """One hyperparameter's domain: ``choices``, or ``kind`` over ``[low, high]``."""

    name: str
    choices: tuple[Any, ...] = ()
    kind: str = "choice"
    low: float = 0.0
    high: float = 0.0

    @property
    def finite(self) -> bool:
        """Whether the domain is a finite list (a grid can enumerate it)."""
        return self.kind == "choice"

    def draw(self, rng: random.Random) -> Any:
        """One value."""
        if self.kind == "choice":
            return self.choices[rng.randrange(len(self.choices))]
        if self.kind == "int_uniform":
            return rng.randint(int(self.low), int(self.high))
        if self.kind == "log_uniform":
            return _round(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return _round(rng.uniform(self.low, self.high))

    def to_json(self) -> Any:
        """The dimension as a space file writes it."""
        return list(self.choices) if self.kind == "choice" else {self.kind: [self.low, self.high]}


def _round(v: float) -> float:
    """Three significant digits: candidates print readably and equal their config.json values."""
    return float(f"{v:.3g}")


Space = dict[str, Dim]

#: The architecture dimensions of message-passing models' spaces: depth, residual connections and layer
#: normalization (Platonov et al. 2023: on heterophilous graphs GCN needs residual connections and layer
#: normalization, and up to 5 layers, to reach its published figures). Candidates batch by depth. Pre-norm
#: blocks (their GCN's order) are not in the default: they train one at a time, and on Coauthor CS one dear
#: pre-norm candidate's final runs took the whole budget (docs/tune.md); add ``"pre_norm": [false, true]``
#: with ``--space`` on heterophilous graphs (minesweeper: 87.2 -> 90.0 test ROC-AUC).
_ARCH: dict[str, Any] = {"layers": [2, 3, 4], "residual": [False, True], "norm": ["none", "layer"]}

#: Per model: the default space (see the module docstring for the sources).
DEFAULT_SPACES: dict[str, dict[str, Any]] = {
    "gcn": {"lr": {"log_uniform": [0.002, 0.05]}, "weight_decay": {"log_uniform": [1e-6, 1e-3]},
            "hidden": [32, 64, 128, 256], "dropout": {"uniform": [0.1, 0.8]}, **_ARCH},
    "sage": {"lr": {"log_uniform": [0.002, 0.05]}, "weight_decay": {"log_uniform": [1e-6, 1e-3]},
             "hidden": [64, 128, 256], "dropout": {"uniform": [0.1, 0.8]}, **_ARCH},
    "gin": {"lr": {"log_uniform": [0.001, 0.02]}, "weight_decay": {"log_uniform": [1e-6, 1e-3]},
            "hidden": [64, 128, 256], "dropout": {"uniform": [0.0, 0.7]}, **_ARCH},
    "gat": {"lr": {"log_uniform": [0.002, 0.02]}, "weight_decay": {"log_uniform": [1e-5, 1e-3]},
            "hidden": [8, 16], "dropout": {"uniform": [0.3, 0.8]}},
    "sign": {"lr": {"log_uniform": [0.0005, 0.01]}, "weight_decay": {"log_uniform": [1e-7, 1e-4]},
             "hidden": [128, 256, 512], "dropout": {"uniform": [0.1, 0.7]}},
}


def parse_space(raw: Any, source: str) -> Space:
    """Validate a space given as a dict (from a file or :data:`DEFAULT_SPACES`).

    Raises:
        TrellisUserError: Not an object, an unknown hyperparameter (with a did-you-mean), an empty list,
            a range that is empty, inverted, non-positive for ``log_uniform`` or not two numbers, or a
            value of the wrong type — each naming the key and ``source``.
    """
    if not isinstance(raw, dict) or not raw:
        raise TrellisUserError(f"{source}: a search space is a non-empty JSON object of hyperparameter: values "
                               f"(e.g. {{\"lr\": [0.01, 0.005]}}); tunable: {', '.join(GRID_KEYS)}")
    space: Space = {}
    for key, spec in raw.items():
        name = str(key).replace("-", "_")
        if name not in GRID_KEYS:
            hint = difflib.get_close_matches(name, list(GRID_KEYS), n=1)
            raise TrellisUserError(f"{source}: unknown hyperparameter {key!r}"
                                   + (f"; did you mean {hint[0]!r}?" if hint else "")
                                   + f" (tunable: {', '.join(GRID_KEYS)})")
        gk = GRID_KEYS[name]
        where = f"{source}: {key}"
        if isinstance(spec, list):
            if not spec:
                raise TrellisUserError(f"{where} is an empty list: give at least one value")
            values = tuple(parse_grid_value(gk, str(v), f"{key}={v}", flag=source) for v in spec)
            if len(set(values)) != len(values):
                raise TrellisUserError(f"{where} lists a value twice")
            space[name] = Dim(name, values)
            continue
        if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in RANGE_KINDS):
            raise TrellisUserError(f"{where}: expected a list of values or one of "
                                   + ", ".join(f'{{"{k}": [low, high]}}' for k in RANGE_KINDS))
        kind, bounds = next(iter(spec.items()))
        if gk.kind in ("choice", "bool"):
            raise TrellisUserError(f"{where}: {name} takes a list of choices ({', '.join(gk.choices)}), not a range")
        if (not isinstance(bounds, list) or len(bounds) != 2
                or not all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds)):
            raise TrellisUserError(f"{where}: {kind} needs [low, high], two finite numbers")
        low, high = float(bounds[0]), float(bounds[1])
        if not low < high:
            raise TrellisUserError(f"{where}: the range [{bounds[0]}, {bounds[1]}] is empty; low must be below high")
        if kind == "log_uniform" and low <= 0:
            raise TrellisUserError(f"{where}: log_uniform needs low > 0 (got {bounds[0]}); list 0 as a choice instead")
        if gk.kind == "int" and kind != "int_uniform":
            raise TrellisUserError(f"{where}: {name} is an integer; use int_uniform or a list")
        if gk.kind == "float" and kind == "int_uniform":
            raise TrellisUserError(f"{where}: {name} is a number; use uniform or log_uniform")
        space[name] = Dim(name, (), kind, low, high)
    return space


#: What out-of-core tiles cannot train (``nn.batched.check_tileable``): a default space under ``--memory-budget``
#: leaves these dimensions out (its candidates were refused, naming flags the user had not given).
NOT_TILEABLE = ("residual", "norm")


def load_space(spec: str | None, model: str, *, out_of_core: bool = False) -> Space:
    """``--space``: ``default`` (or None) = the model's default space; otherwise a JSON file.

    ``out_of_core``: the candidates train under ``--memory-budget`` (full-batch tiles): the default space
    without :data:`NOT_TILEABLE`.

    Raises:
        TrellisUserError: No default space for ``model``, a missing or unreadable file, bad JSON, or a bad
            space (:func:`parse_space`).
    """
    if spec in (None, "default"):
        if model not in DEFAULT_SPACES:
            raise TrellisUserError(f"--model {model}: no default search space (defaults: "
                                   f"{', '.join(DEFAULT_SPACES)}); give one with --space FILE or --grid")
        raw = {k: v for k, v in DEFAULT_SPACES[model].items() if not (out_of_core and k in NOT_TILEABLE)}
        return parse_space(raw, f"default space of {model}")
    path = Path(spec)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise TrellisUserError(f"--space {spec}: no such file (give a JSON file or 'default')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrellisUserError(f"--space {spec}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise TrellisUserError(f"--space {spec}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    return parse_space(raw, f"--space {spec}")


def space_size(space: Space) -> float:
    """Number of distinct candidates (infinite when a dimension is a range)."""
    return math.prod(len(d.choices) for d in space.values()) if all(d.finite for d in space.values()) else math.inf


def candidates(space: Space, n: int, seed: int, search: str = "auto") -> tuple[list[dict[str, Any]], str]:
    """The candidates to try and how they were chosen (``grid`` or ``random``).

    ``auto`` enumerates the grid when the space is finite and has at most ``n`` points, else draws ``n``
    distinct points at random. ``grid`` enumerates every point (refused for ranges). Random draws are
    deterministic from ``seed`` and never repeat a point.
    """
    size = space_size(space)
    if search == "grid" or (search == "auto" and size <= n):
        if not math.isfinite(size):
            ranged = ", ".join(d.name for d in space.values() if not d.finite)
            raise TrellisUserError(f"--search grid: {ranged} is a range; a grid needs lists of values "
                                   "(or use --search random)")
        keys = list(space)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(space[k].choices for k in keys))], "grid"
    rng = random.Random(seed)
    seen: set[tuple[Any, ...]] = set()
    out: list[dict[str, Any]] = []
    tries = 0
    while len(out) < min(n, size) and tries < 100 * n:
        tries += 1
        point = {k: d.draw(rng) for k, d in space.items()}
        key = tuple(point.values())
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out, "random"


def space_to_json(space: Space) -> dict[str, Any]:
    """The space as a space file writes it (the tune records it in ``tune.json``)."""
    return {k: d.to_json() for k, d in space.items()}
