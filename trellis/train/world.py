"""The processes a run trains in: who this one is and what they agree on, apart from how a step trains.

Why a seam of its own: the trainer needs four things from the processes of a distributed run — whether this
one writes the run directory, a barrier after each checkpoint, agreement on stopping, and nothing else —
and a strategy that trains across ranks should not re-implement them beside its exchanges. A strategy's
:attr:`~trellis.train.strategy.Strategy.world` is :data:`LOCAL` (one process) unless it trains across
ranks, where it is the run's :class:`~trellis.distributed.comm.Comm`.
"""

from __future__ import annotations

from typing import Protocol


class World(Protocol):
    """The processes of one run (one by default)."""

    @property
    def rank(self) -> int:
        """This process's rank; rank 0 writes the run directory."""
        ...

    @property
    def world_size(self) -> int:
        """Number of processes."""
        ...

    def barrier(self, what: str) -> None:
        """Wait until every process got here (``what`` names the point in errors)."""
        ...

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true in any process (agreement on stopping)."""
        ...

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum of ``values`` over the processes."""
        ...


class LocalWorld:
    """One process: rank 0 of 1; barriers return at once."""

    rank = 0
    world_size = 1

    def barrier(self, what: str) -> None:
        """Nothing to wait for."""

    def any(self, flag: bool) -> bool:
        """The flag itself."""
        return flag

    def sum(self, values: list[float]) -> list[float]:
        """The values themselves."""
        return list(values)


#: The world of a one-process run.
LOCAL: World = LocalWorld()
