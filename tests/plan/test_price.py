import dataclasses
import math

import pytest

from trellis.errors import TrellisUserError
from trellis.plan.price import Price, run_value
from trellis.plan.rank_cost import CostInputs, predict, priced


def test_a_price_per_machine_or_per_resource():
    assert Price.parse("0.34") == Price(0.34) and Price.parse("$0.34").machine == 0.34
    p = Price.parse("core=0.04, gib=0.005")
    assert p.machine is None and p.machine_hourly(16, 32) == pytest.approx(16 * 0.04 + 32 * 0.005)
    assert Price.parse("gib=0.01").machine_hourly(4, 2) == pytest.approx(0.02)
    for bad in ("", "free", "-1", "0", "core=", "cpu=0.1", "core=0.1,ram=2"):
        with pytest.raises(TrellisUserError, match="--price-per-hour"):
            Price.parse(bad)


def test_value_is_one_over_time_times_cost():
    v = run_value(2.0, [0.36, 0.36])  # two machines at $0.36/h, a 2 s epoch
    assert v["cost_per_epoch_usd"] == pytest.approx(0.72 * 2 / 3600)
    assert v["value"] == pytest.approx(1 / (2.0 * 0.72 * 2 / 3600))
    # twice as fast on the same machines: four times the value (Dorylus's measure rewards speed twice)
    assert run_value(1.0, [0.36, 0.36])["value"] == pytest.approx(4 * v["value"])


def test_predictions_are_priced_and_staleness_hides_the_exchange():
    inp = CostInputs(ranks=4, compute_s=8.0, machines=4, cores=4, exchanges=4, sent_bytes=[1e9] * 4,
                     bandwidth=1.25e9)
    blocking, stale = predict(inp), predict(dataclasses.replace(inp, stale=True))
    assert blocking.total_s == pytest.approx(blocking.compute_s + blocking.comm_s)
    assert stale.total_s == pytest.approx(max(stale.compute_s, stale.comm_s))
    assert stale.total_s < blocking.total_s
    v = priced(blocking, inp, Price(0.1785))
    assert v["cost_per_hour_usd"] == pytest.approx(4 * 0.1785)
    assert math.isclose(v["value"], 1 / (blocking.total_s * v["cost_per_epoch_usd"]))
