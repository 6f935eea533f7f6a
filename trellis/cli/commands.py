"""The ``trellis`` subcommands: name, the module that registers it, and its one-line help.

Why a table apart from the modules: ``trellis --help`` and an unknown command need only these lines, and a
subcommand needs only its own module. Importing every module would import torch (about 2.5 s) for a help
screen or for ``trellis data info``.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Command(NamedTuple):
    """One subcommand: ``module`` defines ``register(subparsers)``, which adds it with :func:`help_of`."""

    name: str
    module: str
    help: str


#: In the order ``trellis --help`` lists them.
COMMANDS = (
    Command("data", "trellis.cli.data", "import datasets, generate graphs, describe stores"),
    Command("partition", "trellis.cli.partition", "partition a graph store and write the partitioned layout"),
    Command("preprocess", "trellis.cli.preprocess", "pre-propagate features for SGC/SIGN/HOGA (out of core, cached)"),
    Command("train", "trellis.cli.train", "train a GNN on a graph store and write a run directory"),
    Command("predict", "trellis.cli.train",
            "write predictions and embeddings of a trained run for every node of a store"),
    Command("sweep", "trellis.cli.sweep", "train a hyperparameter grid with model batching; leaderboard and plot"),
    Command("tune", "trellis.cli.tune",
            "search hyperparameters (successive halving on the batched sweep), report test accuracy over seeds"),
    Command("compare", "trellis.cli.compare",
            "compare finished runs: metric, epoch time, time to a target, memory; validation curves against wall time"),
    Command("bench", "trellis.cli.bench", "benchmark Trellis components on a store"),
    Command("demo", "trellis.cli.demo",
            "generate a graph, train GCN on it, print accuracy and time (under 2 minutes)"),
)


def help_of(name: str) -> str:
    """The one-line help of subcommand ``name``."""
    return next(c.help for c in COMMANDS if c.name == name)


__all__ = ["COMMANDS", "Command", "help_of"]


def help_text(doc: str | None) -> str:
    """A module docstring as a ``--help`` description: reST roles and double backquotes read as plain text."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")
