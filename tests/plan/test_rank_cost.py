import math

import pytest

from trellis.plan.rank_cost import (
    CostInputs,
    exchange_row_floats,
    halo_sent_bytes,
    predict,
    speedup,
    thread_efficiency,
    work_shares,
)


def inputs(**kw):
    base = dict(ranks=4, compute_s=8.0, cores=4, sent_bytes=[1e9] * 4, exchanges=3, bandwidth=1e9, latency_s=1e-3)
    base.update(kw)
    return CostInputs(**base)


def test_one_rank_is_the_reference_and_sends_nothing():
    out = predict(CostInputs(ranks=1, compute_s=2.5, compute_threads=4, thread_efficiency=0.6, cores=4,
                             sent_bytes=[123.0], exchanges=5, allreduces=2, allreduce_bytes=1e6))
    assert out.compute_s == pytest.approx(2.5)
    assert out.comm_s == 0.0
    assert out.total_s == pytest.approx(2.5)


def test_eq3_balanced_one_thread_per_partition():
    # W / P * max(P / (M L), 1): W = 8 s on one core
    for p, cores, machines, want in [(2, 4, 1, 4.0), (4, 4, 1, 2.0), (8, 4, 1, 2.0), (16, 2, 2, 2.0),
                                     (16, 4, 4, 0.5), (3, 2, 1, 8.0 / 3 * 1.5)]:
        out = predict(CostInputs(ranks=p, compute_s=8.0, cores=cores, machines=machines))
        assert out.compute_s == pytest.approx(want), (p, cores, machines)


def test_ranks_beyond_cores_do_not_shrink_compute():
    two = predict(inputs(ranks=2, cores=2, sent_bytes=[]))
    four = predict(inputs(ranks=4, cores=2, sent_bytes=[]))
    eight = predict(inputs(ranks=8, cores=2, sent_bytes=[]))
    assert four.compute_s == pytest.approx(two.compute_s)
    assert eight.compute_s == pytest.approx(two.compute_s)
    assert four.rounds == 2.0 and eight.rounds == 4.0


def test_doubling_bandwidth_halves_the_bandwidth_term():
    slow = predict(inputs(bandwidth=1e9))
    fast = predict(inputs(bandwidth=2e9))
    assert fast.bandwidth_s == pytest.approx(slow.bandwidth_s / 2)
    assert fast.latency_s == pytest.approx(slow.latency_s)
    assert fast.compute_s == pytest.approx(slow.compute_s)
    assert slow.bandwidth_s == pytest.approx(1.0)  # 1e9 bytes at 1e9 B/s
    assert slow.total_s == pytest.approx(slow.compute_s + slow.latency_s + slow.bandwidth_s)


def test_latency_grows_with_ranks_and_exchanges():
    out = predict(inputs(ranks=4, exchanges=3, latency_s=1e-3, sent_bytes=[]))
    assert out.latency_s == pytest.approx(3 * 3 * 1e-3)
    more = predict(inputs(ranks=8, exchanges=3, latency_s=1e-3, sent_bytes=[]))
    assert more.latency_s == pytest.approx(3 * 7 * 1e-3)


def test_allreduce_is_a_ring():
    out = predict(CostInputs(ranks=4, compute_s=1.0, cores=4, allreduces=1, allreduce_bytes=4e6, bandwidth=1e9,
                             latency_s=1e-4))
    assert out.bandwidth_s == pytest.approx(2 * 3 / 4 * 4e6 / 1e9)
    assert out.latency_s == pytest.approx(2 * 3 * 1e-4)


def test_the_most_loaded_rank_dominates():
    balanced = predict(inputs(work=[1, 1, 1, 1], sent_bytes=[1e9, 1e9, 1e9, 1e9]))
    skewed = predict(inputs(work=[5, 1, 1, 1], sent_bytes=[1e9, 1e9, 1e9, 4e9]))
    assert balanced.max_share == pytest.approx(0.25)
    assert skewed.max_share == pytest.approx(5 / 8)
    assert skewed.compute_s == pytest.approx(balanced.compute_s * 2.5)
    assert skewed.bandwidth_s == pytest.approx(4 * balanced.bandwidth_s)  # the biggest sender, not the mean
    # only the ratios of the work matter
    assert predict(inputs(work=[10, 2, 2, 2])).compute_s == pytest.approx(skewed.compute_s)


def test_threads_per_rank_and_efficiency():
    # reference: 2 s on 4 threads at e = 1 -> W = 8 s; 2 ranks get 2 threads each
    out = predict(CostInputs(ranks=2, compute_s=2.0, compute_threads=4, thread_efficiency=1.0, cores=4))
    assert out.serial_work_s == pytest.approx(8.0)
    assert out.threads_per_rank == 2
    assert out.compute_s == pytest.approx(2.0)  # perfect threads: partitioning only moves cores around
    zero = predict(CostInputs(ranks=2, compute_s=2.0, compute_threads=4, thread_efficiency=0.0, cores=4))
    assert zero.compute_s == pytest.approx(1.0)  # useless threads: Eq. 3, W / P
    assert speedup(4, 0.5) == pytest.approx(2.5)
    assert thread_efficiency(8.0, 2.0, 4) == pytest.approx(1.0)
    assert thread_efficiency(8.0, 8.0, 4) == 0.0
    assert thread_efficiency(8.0, 16.0, 4) == 0.0  # slower on more threads: clipped
    assert thread_efficiency(8.0, 5.0, 2) == pytest.approx(0.6)


def test_ranks_spread_over_machines():
    # 16 ranks on 16 machines of 32 cores: one rank per machine, 32 threads each
    out = predict(CostInputs(ranks=16, compute_s=64.0, cores=32, machines=16, thread_efficiency=0.5))
    assert out.threads_per_rank == 32 and out.rounds == 1.0
    assert out.compute_s == pytest.approx(64.0 / 16 / (1 + 0.5 * 31))


def test_helpers():
    assert work_shares([10, 20], [1, 2], node_weight=2.0) == [12.0, 24.0]
    assert work_shares([10, 20], [1, 2], [3, 4], halo_weight=0.5) == [12.5, 24.0]
    assert halo_sent_bytes([10, 0], 96) == [3840.0, 0.0]
    assert exchange_row_floats(3840.0 * 3, 30) == pytest.approx(96.0)
    assert exchange_row_floats(1.0, 0) == 0.0
    with pytest.raises(ValueError):
        work_shares([1], [1, 2])
    with pytest.raises(ValueError):
        work_shares([1, 2], [1, 2], [1])


def test_halo_work_counts_against_the_single_process():
    # two balanced parts of a graph with 100 units of work, each part also packs 20 units of halo rows
    out = predict(CostInputs(ranks=2, compute_s=10.0, cores=2, work=[70.0, 70.0], total_work=100.0))
    assert out.max_share == pytest.approx(0.7)
    assert out.compute_s == pytest.approx(7.0)
    # without total_work only the ratios matter
    assert predict(CostInputs(ranks=2, compute_s=10.0, cores=2, work=[70.0, 70.0])).compute_s == pytest.approx(5.0)


@pytest.mark.parametrize("bad", [dict(ranks=0), dict(bandwidth=0.0), dict(thread_efficiency=1.5),
                                 dict(work=[1, 1]), dict(sent_bytes=[1.0]), dict(work=[0, 0, 0, 0]),
                                 dict(compute_s=-1.0)])
def test_rejects_bad_inputs(bad):
    with pytest.raises(ValueError):
        inputs(**bad)


def test_monotone_in_bytes():
    a = predict(inputs(sent_bytes=[1e8] * 4)).total_s
    b = predict(inputs(sent_bytes=[2e8] * 4)).total_s
    assert b > a and math.isclose(b - a, 0.1)
