import numpy as np
import pytest

from trellis.partition import part_cap, partition_graph
from trellis.partition.metis import enforce_cap, run_metis, symmetric_adjacency

from .conftest import csr_from_edges, cut_frac


def test_symmetric_adjacency_drops_loops_and_weights_duplicates():
    indptr, indices = csr_from_edges(3, np.array([0, 1, 2, 2]), np.array([1, 0, 2, 0]))
    xadj, adjncy, w = symmetric_adjacency(indptr, indices, 3)
    rows = np.repeat(np.arange(3), np.diff(xadj))
    got = {(int(r), int(c)): int(x) for r, c, x in zip(rows, adjncy, w)}
    assert got == {(0, 1): 2, (1, 0): 2, (0, 2): 1, (2, 0): 1}


def test_metis_recovers_planted_partition(planted_store):
    store, truth = planted_store
    book = partition_graph(store, "metis", 4, measure=False)
    assert cut_frac(store, book.node_parts) <= cut_frac(store, truth) + 0.005
    assert book.part_sizes().max() <= part_cap(store.num_nodes, 4, 0.05)


def test_enforce_cap_moves_surplus_nodes():
    indptr, indices = csr_from_edges(6, np.array([0, 1, 2, 3, 4]), np.array([1, 2, 3, 4, 5]))
    xadj, adjncy, _ = symmetric_adjacency(indptr, indices, 6)
    parts = np.zeros(6, dtype=np.int32)
    moved = enforce_cap(xadj, adjncy, parts, 2, 3, seed=0)  # the empty part gets the surplus
    assert moved == 3 and np.bincount(parts, minlength=2).tolist() == [3, 3]
    assert enforce_cap(xadj, adjncy, parts, 2, 3, seed=0) == 0


def test_run_metis_without_edges_deals_round_robin():
    parts = run_metis(np.zeros(5, dtype=np.int64), np.zeros(0, dtype=np.int64), None, 2, imbalance=0.0, seed=0)
    assert np.bincount(parts).tolist() == [2, 2]


def _two_communities(tmp_path):
    """Two dense 200-node communities joined by a few edges; every training node is in the first."""
    from trellis.data.convert import from_arrays

    rng = np.random.default_rng(0)
    src, dst = [], []
    for base in (0, 200):
        s = rng.integers(0, 200, 3000) + base
        d = rng.integers(0, 200, 3000) + base
        src.append(s)
        dst.append(d)
    src.append(rng.integers(0, 200, 10))
    dst.append(rng.integers(200, 400, 10))
    train = np.arange(0, 200, 2)  # 100 training nodes, all in the first community
    return from_arrays(np.concatenate(src), np.concatenate(dst), 400, out=tmp_path / "two",
                       y=np.zeros(400, dtype=np.int64), splits={"train": train, "val": [201], "test": [202]},
                       remove_self_loops=True)


@pytest.mark.parametrize("method", ["metis", "grem"])
def test_balance_train_gives_every_part_its_share_of_training_nodes(tmp_path, method):
    from trellis.data.store import GraphStore
    from trellis.partition import partition_graph

    store = GraphStore(_two_communities(tmp_path))
    train = np.asarray(store.split("train"))
    plain = partition_graph(store, method, 2, measure=False).node_parts
    balanced = partition_graph(store, method, 2, measure=False, balance="train")
    assert np.bincount(plain[train], minlength=2).max() >= 90  # the cut follows the communities
    counts = np.bincount(balanced.node_parts[train], minlength=2)
    assert counts.max() <= 100 / 2 * 1.1 and np.bincount(balanced.node_parts).max() <= 400 / 2 * 1.06
    assert balanced.params["balance"] == "train" and balanced.params["rebalanced"] > 0
    assert balanced.params["balance_train"] <= 1.1


@pytest.mark.parametrize("method", ["metis", "grem"])
def test_balance_train_leaves_no_part_without_a_training_node(tmp_path, method):
    """The caps bound the most a part holds, not the least: 4 training nodes over 4 parts were capped at 2 each
    and one part held none (its rank refused to train, advising --balance train, which had been given)."""
    from trellis.data.generate import generate_sbm
    from trellis.data.store import GraphStore
    from trellis.partition.balance import give_every_part_a_training_node

    store = GraphStore(generate_sbm(tmp_path / "tiny", nodes=40, avg_degree=4, progress=False))
    train = np.asarray(store.split("train"))
    assert len(train) == 4
    for seed in range(5):
        book = partition_graph(store, method, 4, measure=False, balance="train", seed=seed)
        assert np.bincount(book.node_parts[train], minlength=4).tolist() == [1, 1, 1, 1], seed
        assert book.part_sizes().max() <= part_cap(store.num_nodes, 4, 0.05)
    # the swap itself: node counts stay, every part gets one
    parts = np.repeat(np.arange(4), 10).astype(np.int64)
    mask = np.zeros(40, dtype=bool)
    mask[[0, 1, 2, 3]] = True  # every training node in part 0
    swaps = give_every_part_a_training_node(np.asarray(store.indptr), np.asarray(store.indices), parts, mask, 4)
    assert swaps == 3 and np.bincount(parts[mask], minlength=4).tolist() == [1, 1, 1, 1]
    assert np.bincount(parts, minlength=4).tolist() == [10, 10, 10, 10]
    fewer = np.zeros(40, dtype=bool)
    fewer[[0, 1]] = True  # fewer training nodes than parts: nothing to do
    assert give_every_part_a_training_node(np.asarray(store.indptr), np.asarray(store.indices), parts, fewer, 4) == 0


@pytest.mark.parametrize("method", ["metis", "grem"])
def test_balance_edges_evens_in_edges_as_well_as_nodes_and_training_nodes(tmp_path, method):
    """On a power-law graph a node-balanced min cut leaves one part with about 2-3x the mean in-edges."""
    from trellis.data.generate import generate_rmat
    from trellis.data.store import GraphStore
    from trellis.partition import partition_graph

    store = GraphStore(generate_rmat(tmp_path / "r", nodes=2000, avg_degree=8, features=4, classes=4, seed=0,
                                     progress=False))
    deg = np.diff(np.asarray(store.indptr))
    train = np.asarray(store.split("train"))

    def ratio(parts: np.ndarray, w: np.ndarray | None = None, rows: np.ndarray | None = None) -> float:
        per = np.bincount(parts if rows is None else parts[rows], weights=w, minlength=4)
        return float(per.max() / per.mean())

    plain = partition_graph(store, method, 4, measure=False).node_parts
    both = partition_graph(store, method, 4, measure=False, balance="train,edges")
    assert ratio(plain, deg) > 1.5
    assert ratio(both.node_parts, deg) <= 1.05 + 1e-9 and ratio(both.node_parts) <= 1.05 + 1e-9
    assert ratio(both.node_parts, rows=train) <= 1.06  # (ceil of 200/4 * 1.05 = 53 of a mean of 50)
    assert both.params["balance"] == "train,edges"
    assert both.params["balance_edges"] == pytest.approx(ratio(both.node_parts, deg))


def test_balance_names_are_checked(sbm_store, capsys):
    from trellis.cli.main import main

    assert main(["partition", str(sbm_store), "--parts", "2", "--balance", "train,degree", "--no-layout"]) == 2
    assert "--balance 'train,degree': give one or more of nodes, train, edges" in capsys.readouterr().err


def test_balance_is_refused_where_it_cannot_apply(sbm_store, capsys):
    from trellis.cli.main import main

    assert main(["partition", str(sbm_store), "--parts", "2", "--method", "hash", "--balance", "train",
                 "--no-layout"]) == 2
    assert "--balance train moves nodes between parts of a destination-owned layout" in capsys.readouterr().err
