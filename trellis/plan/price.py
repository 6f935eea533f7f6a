"""What a run costs: dollars per epoch and Dorylus's value, ``1 / (time x cost)`` (Dorylus §7.5).

``--price-per-hour`` prices a run two ways:

* ``PRICE`` (e.g. ``0.34``): dollars per machine-hour, one rank per machine (the single process is one
  machine);
* ``core=C,gib=G`` (e.g. ``core=0.0425,gib=0.0057``): dollars per core-hour and per GiB-hour of memory, so a
  machine costs ``C x cores + G x GiB``. A run's machines are priced by what each rank used: its threads and
  its peak anonymous memory (RssAnon).

The cost of an epoch is ``machines x machine price x epoch seconds / 3600``; the value of a configuration
is ``1 / (epoch seconds x cost of an epoch)`` per second-dollar: higher is better, and it rewards speed
twice, as Dorylus's does (a run that is twice as fast on the same machines has four times the value). The
cost model's predictions (:mod:`trellis.plan.rank_cost`) are priced by the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from trellis.errors import TrellisUserError

_PART = re.compile(r"\s*(core|gib)\s*=\s*([0-9]*\.?[0-9]+)\s*")


@dataclass(frozen=True)
class Price:
    """Dollars per hour: of a whole machine, or of its cores and memory.

    Attributes:
        machine: Per machine-hour (None: priced by resource).
        core: Per core-hour.
        gib: Per GiB-hour of memory.
    """

    machine: float | None = None
    core: float = 0.0
    gib: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Price:
        """``0.34`` or ``core=0.0425,gib=0.0057``.

        Raises:
            TrellisUserError: Naming ``--price-per-hour`` and both forms.
        """
        hint = ("write dollars per machine-hour (e.g. 0.34) or per resource-hour (e.g. core=0.0425,gib=0.0057)")
        t = str(text).strip().lstrip("$")
        try:
            value = float(t)
        except ValueError:
            parts = [_PART.fullmatch(p) for p in t.split(",")]
            if not t or not all(parts):
                raise TrellisUserError(f"--price-per-hour {text!r}: {hint}") from None
            got = {m.group(1): float(m.group(2)) for m in parts if m is not None}
            return cls(None, got.get("core", 0.0), got.get("gib", 0.0))
        if not value > 0:
            raise TrellisUserError(f"--price-per-hour {text!r}: the price must be positive; {hint}")
        return cls(value)

    def machine_hourly(self, cores: float, gib: float) -> float:
        """Dollars per hour of one machine with ``cores`` cores and ``gib`` GiB."""
        return self.machine if self.machine is not None else self.core * cores + self.gib * gib

    def describe(self) -> str:
        """The price as it was given."""
        if self.machine is not None:
            return f"${self.machine:g}/machine-hour"
        return f"${self.core:g}/core-hour + ${self.gib:g}/GiB-hour"


def run_value(epoch_s: float, machine_hourly: list[float]) -> dict[str, Any]:
    """Cost per epoch (dollars) and value ``1 / (epoch_s x cost)`` of machines priced ``machine_hourly`` each."""
    cost = sum(machine_hourly) * epoch_s / 3600.0
    return {"cost_per_epoch_usd": cost, "cost_per_hour_usd": sum(machine_hourly),
            "value": 1.0 / (epoch_s * cost) if epoch_s > 0 and cost > 0 else None}
