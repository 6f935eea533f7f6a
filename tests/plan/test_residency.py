"""The partition buffer's residency plan: what it counts, and the budgets it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from trellis.errors import TrellisUserError
from trellis.plan.residency import BufferCosts, plan_buffer

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
