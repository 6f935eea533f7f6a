"""The partition buffer's residency plan: what it counts, and the budgets it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from trellis.errors import TrellisUserError
from trellis.plan.residency import MARGIN_BYTES, BufferCosts, plan_buffer
from trellis.utils.sizes import parse_size

GIB = 2**30


def _costs(**kw: int) -> BufferCosts:
    base = dict(num_nodes=1_000_000, num_parts=16, part_rows=62_500, part_edges=625_000, row_bytes=1024,
                model_bytes=1 << 20, batch_bytes=256 << 20, baseline=200 << 20)
    return BufferCosts(**{**base, **kw})


def test_evaluation_counts_in_the_plan():
    """Scoring 24M rows of 16 logits holds about 3 GiB at its peak; a plan that left it out overran its budget
    by that much (measured: 9.7 GiB against 7.45 planned). The plan now counts it and shrinks the cache."""
    lean = _costs()
    scored = dataclasses.replace(lean, eval_bytes=GIB)
    assert scored.fixed_bytes == lean.fixed_bytes + GIB
    budget = lean.fixed_bytes + 20 * lean.slot_bytes
    a, b = plan_buffer(lean, budget), plan_buffer(scored, budget)
    assert b.capacity < a.capacity  # the evaluation's gigabyte comes out of the parts and the cache
    assert "evaluation" in b.table()
    with pytest.raises(TrellisUserError, match="smallest budget that works"):
        plan_buffer(scored, lean.fixed_bytes + 2 * lean.slot_bytes)


def test_the_table_adds_up_to_what_the_planner_checks():
    """--explain's total left out the 64 MiB head-room, so a budget above the total it showed was refused."""
    costs = _costs()
    plan = plan_buffer(costs, costs.fixed_bytes + 5 * costs.slot_bytes)
    slots = min(plan.capacity + 1, costs.num_parts)
    total = costs.fixed_bytes + slots * costs.slot_bytes + plan.cache_rows * costs.row_bytes
    assert "head-room" in plan.table() and str(MARGIN_BYTES // 2**20) in plan.table()
    shown = plan.table().splitlines()[-1].split()[1:3]
    assert abs(parse_size("".join(shown)) - total) <= 0.01 * total  # the table's rounding


def test_the_smallest_budget_named_is_one_the_parser_reads_and_the_planner_takes():
    """It was named in GiB with two decimals; `G` is decimal, so typing it back was refused."""
    costs = _costs()
    with pytest.raises(TrellisUserError, match=r"\(--memory-budget (\d+)MiB\)") as err:
        plan_buffer(costs, costs.fixed_bytes)
    given = err.value.args[0].split("(--memory-budget ")[1].split(")")[0]
    plan_buffer(costs, parse_size(given))
