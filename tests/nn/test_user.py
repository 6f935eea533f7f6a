"""User-defined layers (trellis/nn/user.py): message / aggregate / update in torch, planned like built-ins.

A user GCN equals the built-in one and is pushed down and model-batched like it; a user edge-MLP layer (a
parameterized message) gets the general plan and trains under every strategy, ranks included.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import trellis
from examples.user_layers import EdgeMLP, UserGCN, edge_mlp, user_gcn
from tests.nn.test_layers import random_graph
from trellis.errors import TrellisUserError
from trellis.nn import GNN, GCNConv, MessagePassing, build_model
from trellis.nn.batched import BatchedGNN, capture_generator, check_tileable, family_of
from trellis.nn.models import register_model


def test_user_gcn_is_the_builtin_pushed_down():
    torch.manual_seed(0)
    g, _ = random_graph(n=40, p=0.2)
    builtin, mine = GCNConv(6, 4), UserGCN(6, 4)
    mine.load_state_dict(builtin.state_dict())
    decl = mine.declare()
    assert (decl.message, decl.aggregate, decl.transform) == ("weighted", "sum", True) and mine.pushdown
    for grad in (False, True):
        x = torch.randn(40, 6, requires_grad=grad)
        assert mine.step_plan(g, x).aggregate_first == builtin.step_plan(g, x).aggregate_first
        a, b = builtin(g, x), mine(g, x)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        a.square().sum().backward()
        b.square().sum().backward()
    torch.testing.assert_close(mine.lin.weight.grad, builtin.lin.weight.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine.bias.grad, builtin.bias.grad, rtol=0, atol=1e-6)


def test_user_gcn_trains_the_builtin_losses(sbm_store):
    for strategy in ("full", "mini"):
        ours = trellis.train(sbm_store, model="gcn", strategy=strategy, epochs=5, hidden=16)
        theirs = trellis.train(sbm_store, model=user_gcn, strategy=strategy, epochs=5, hidden=16)
        np.testing.assert_allclose([r["loss"] for r in theirs.history], [r["loss"] for r in ours.history],
                                   rtol=0, atol=1e-6)


def test_user_gcn_model_batches_like_solo_runs():
    g, _ = random_graph(n=50, p=0.1, seed=2)
    x = torch.randn(50, 6)

    def build(k):
        torch.manual_seed(k)
        return user_gcn(6, 3, hidden=4 + 4 * k, dropout=0.3), capture_generator("cpu")

    ref = []
    for k in range(3):
        m, gen = build(k)
        torch.set_rng_state(gen.get_state())
        ref.append(m(g, x).detach())
    built = [build(k) for k in range(3)]
    assert family_of(built[0][0]) == "user:UserGCN"
    bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
    for out, r in zip(bm(g, x), ref):
        torch.testing.assert_close(out, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(TrellisUserError, match="out-of-core tiles run the built-in"):
        check_tileable(built[0][0])


def test_edge_mlp_gets_the_general_plan_and_its_gradients():
    torch.manual_seed(3)
    g, adj = random_graph(n=20, p=0.3)
    layer = EdgeMLP(5, 4)
    assert layer.declare().message == "custom" and not layer.pushdown
    x = torch.randn(20, 5, dtype=torch.float64, requires_grad=True)
    layer.double()
    out = layer(g, x)
    # dense reference: mean over in-neighbours of mlp([x_i, x_j]) plus the root term
    ref = torch.zeros_like(out)
    for i in range(20):
        nb = torch.nonzero(adj[i]).flatten()
        if len(nb):
            ref[i] = layer.mlp(torch.cat([x[i].expand(len(nb), 5), x[nb]], -1)).mean(0)
    ref = ref + layer.root(x)
    torch.testing.assert_close(out, ref)
    assert torch.autograd.gradcheck(lambda t: layer(g, t), (x,), eps=1e-6, atol=1e-5)



class _MaxCopy(MessagePassing):
    """A copy message under max: not pushed down, but no per-edge matmul either (the transform runs per node)."""

    aggregate = "max"
    transform = "lin"

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim, bias=False)

    def message(self, x_j: torch.Tensor) -> torch.Tensor:
        return x_j


class _MeanNoTransform(MessagePassing):
    """A pushed-down mean with no transform: its plan has no linear map and no bias."""

    aggregate = "mean"

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = in_dim  # the aggregation's widths; the update maps to out_dim
        self.post = nn.Linear(in_dim, out_dim)

    def message(self, x_j: torch.Tensor) -> torch.Tensor:
        return x_j

    def update(self, aggr: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.post(aggr + x)


def test_explain_describes_what_a_user_layer_runs(sbm_store):
    """--explain priced a copy message under max as a per-edge 16->16 matmul ("parameterized message"), gave a
    pushed-down layer without a transform a linear map and a bias, and priced EdgeMLP (no transform) at width 1."""
    g, _ = random_graph(n=40, p=0.2)
    ops = [(o.kind, o.detail) for o in _MaxCopy(6, 4).plan(g).ops]
    assert [k for k, _ in ops] == ["linear", "gather", "segment_reduce"] and ops[1][1] == "source rows width 4"
    assert "not linear" in " ".join(_MaxCopy(6, 4).plan(g).notes)
    text = trellis.explain(sbm_store, model=lambda_free_builder, epochs=1)
    first = text.split("_meannotransform[0]")[1].split("_meannotransform[1]")[0]
    assert "spmm" in first and "linear" not in first and "bias" not in first
    edge = [(o.kind, o.detail) for o in EdgeMLP(5, 4).plan(g).ops]
    assert ("apply_edge", "message 5->4") in edge

    class Unstated(EdgeMLP):
        def __init__(self) -> None:
            super().__init__(5, 4)
            del self.in_dim, self.out_dim

    assert "priced at width 1" in " ".join(Unstated().plan(g).notes)


def test_a_layer_without_a_transform_takes_sparse_rows():
    """Sparse (bag-of-words) rows are transformed first; a layer without a transform asserted on them."""
    torch.manual_seed(0)
    g, _ = random_graph(n=30, p=0.2)
    x = torch.randn(30, 6)
    x[x < 0.5] = 0
    layer = _MeanNoTransform(6, 4)
    torch.testing.assert_close(layer(g, x.to_sparse_csr()), layer(g, x), rtol=0, atol=0)


def lambda_free_builder(in_dim: int, out_dim: int) -> GNN:
    return GNN([_MeanNoTransform(in_dim, 8), _MeanNoTransform(8, out_dim)], 0.0)


@pytest.mark.parametrize("strategy", ["full", "mini", "cluster"])
def test_edge_mlp_trains_in_every_strategy(sbm_store, strategy):
    extra = {"fanouts": "10,5"} if strategy == "mini" else {}  # another strategy refuses the flag
    run = trellis.train(sbm_store, model=edge_mlp, strategy=strategy, epochs=40, lr=0.01, **extra)
    losses = [r["loss"] for r in run.history]
    assert losses[-1] < 0.7 * losses[0] and run.test_score() > 0.4  # 4 classes: chance is 0.25


def _rank(rank, world, port, jobs):
    register_model("edge_mlp", edge_mlp)  # a spawned rank registers the user's model as the user's script does
    from tests.distributed.test_parallel import _worker

    _worker(rank, world, port, jobs)


def test_edge_mlp_on_two_ranks_equals_one_process(sbm_store, tmp_path):
    from trellis.data.store import GraphStore
    from trellis.distributed.comm import free_port
    from trellis.partition import partition_graph
    from trellis.partition.layout import write_layout
    from trellis.train.config import TrainConfig
    from trellis.train.trainer import Trainer

    register_model("edge_mlp", edge_mlp)
    base = dict(store=str(sbm_store), model="edge_mlp", epochs=4, progress=False, checkpoint_every=0, device="cpu")
    Trainer(TrainConfig(**base, out=str(tmp_path / "one")), err=io.StringIO()).fit()
    gs = GraphStore(sbm_store)
    layout = write_layout(gs, partition_graph(gs, "metis", 2, measure=False), tmp_path / "p2")
    job = TrainConfig(**base, out=str(tmp_path / "two"), parts_dir=str(layout), timeout=120.0).to_dict(session=True)
    mp.spawn(_rank, args=(2, free_port(), [job]), nprocs=2, join=True)
    one = trellis.load_run(tmp_path / "one").history
    two = trellis.load_run(tmp_path / "two").history
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=0, atol=1e-4)


class NoMessage(MessagePassing):
    pass


class BadAggregate(UserGCN):
    aggregate = "median"


class BadArgument(MessagePassing):
    def message(self, x_j, degree):
        return x_j


class WrongShape(MessagePassing):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def message(self, x_j):
        return x_j

    def update(self, aggr):
        return aggr[:1]


class BiasedTransform(UserGCN):
    def __init__(self, in_dim, out_dim):
        super().__init__(in_dim, out_dim)
        self.lin = nn.Linear(in_dim, out_dim)


@pytest.mark.parametrize("cls, match", [
    (NoMessage, "has no message"), (BadAggregate, "aggregates with sum, mean, max"),
    (BadArgument, "unknown argument 'degree'"), (WrongShape, r"update returned \(1, 6\); expected one row per "),
    (BiasedTransform, "has no bias"),
])
def test_bad_layers_are_named(cls, match):
    g, _ = random_graph(n=12)
    layer = cls(6, 6) if cls not in (NoMessage, BadArgument, WrongShape) else cls()
    with pytest.raises(TrellisUserError, match=match):
        layer(g, torch.randn(12, 6))


def test_bad_user_model_is_a_clear_error_before_training(sbm_store, tmp_path):
    def wrong(in_dim, out_dim):
        return GNN([WrongShape(), WrongShape()], 0.5)

    with pytest.raises(TrellisUserError, match="WrongShape.update returned"):
        trellis.train(sbm_store, model=wrong, epochs=2, out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_builtin_models_still_declare(sbm_store):
    assert build_model("gcn", 4, 2).convs[0].declare().message == "weighted"
    assert Path(sbm_store).is_dir()


class _Clipped(MessagePassing):
    """The identity on unit-normal rows, not on large ones: a probe at one scale would call it a copy."""

    aggregate = "sum"

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = d

    def message(self, x_j):
        return x_j.clamp(-5.0, 5.0)


class _DropMessage(MessagePassing):
    """Dropout on the messages: a copy in evaluation mode only."""

    aggregate = "sum"

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = d

    def message(self, x_j):
        return torch.nn.functional.dropout(x_j, 0.5, self.training)


class _Opaque(MessagePassing):
    """A copy on every probe, which the user says must run as written."""

    aggregate = "sum"
    general_plan = True

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = d

    def message(self, x_j):
        return x_j


def test_the_probe_does_not_call_a_clipping_or_dropout_message_a_copy():
    g, adj = random_graph(n=30, p=0.2)
    x = torch.randn(30, 3) * 10
    clipped = _Clipped(3)
    assert clipped.declare().message == "custom" and not clipped.pushdown
    torch.testing.assert_close(clipped(g, x), adj @ x.clamp(-5, 5))
    drop = _DropMessage(3).eval()  # first called in evaluation mode, where it copies
    assert drop.declare().message == "custom" and not drop.training  # the probe restored the mode
    drop.train()
    assert not torch.equal(drop(g, x), drop(g, x))  # dropout applies in training
    opaque = _Opaque(3)
    assert opaque.declare().message == "custom" and not opaque.pushdown
    torch.testing.assert_close(opaque(g, x), adj @ x)


class _BufferScaled(MessagePassing):
    """A message scaled by a buffer that is 1 at first use (a schedule, a running statistic): not a copy."""

    aggregate = "sum"

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_dim = self.out_dim = d
        self.register_buffer("scale", torch.ones(()))
        self.frozen = nn.Parameter(torch.ones(d), requires_grad=False)

    def message(self, x_j):
        return x_j * self.scale


class _BufferBeside(_BufferScaled):
    """A buffer the message does not read: still a copy, pushed down."""

    def message(self, x_j):
        return x_j


def test_a_message_reading_a_buffer_is_not_called_a_copy_and_follows_its_later_values():
    g, adj = random_graph(n=30, p=0.2)
    x = torch.randn(30, 3)
    layer = _BufferScaled(3)
    torch.testing.assert_close(layer(g, x), adj @ x)
    assert layer.declare().message == "custom" and not layer.pushdown
    assert torch.equal(layer.scale, torch.ones(())) and torch.equal(layer.frozen, torch.ones(3))  # restored
    layer.scale.fill_(3.0)
    torch.testing.assert_close(layer(g, x), adj @ (3.0 * x))
    beside = _BufferBeside(3)
    assert beside.declare().message == "copy" and beside.pushdown
