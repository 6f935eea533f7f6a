"""The PP cache (layout, reuse, refusal, interrupted builds) and every loader mode's epoch contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from trellis.data.store import open_store, write_store
from trellis.errors import BudgetTooSmall, TrellisUserError
from trellis.loader.pp import (
    PP_MARGIN_BYTES,
    MemorySource,
    NaiveLoader,
    PPData,
    PPLoader,
    StorageSource,
    epoch_batches,
    expand_ranges,
    plan_placement,
)
from trellis.loader.ppcache import (
    ALIGN,
    MARKER,
    PPSettings,
    build_pp,
    ensure_pp,
    inspect_pp,
    open_pp,
)
from trellis.ops.propagate import OperatorSpec, propagate
from trellis.utils.sizes import parse_size

N, F = 300, 4
REPO = Path(__file__).resolve().parents[2]


def make_store(path: Path, seed: int = 0, n: int = N, shift: float = 0.0) -> Path:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, n, 6 * n)
    dst = rng.integers(0, n, 6 * n)
    a = sp.csr_matrix((np.ones(src.shape[0]), (dst, src)), shape=(n, n))
    a = ((a + a.T) > 0).astype(np.float32).tocsr()
    a.setdiag(0)
    a.eliminate_zeros()
    x = rng.standard_normal((n, F)).astype(np.float32)
    x[:, 0] = np.arange(n) + shift  # hop 0, column 0 identifies the node
    y = rng.integers(0, 3, n)
    perm = rng.permutation(n)
    splits = {"train": np.sort(perm[:200]), "val": np.sort(perm[200:240]), "test": np.sort(perm[240:280])}
    return write_store(path, indptr=a.indptr, indices=a.indices, x=x, y=y, splits=splits)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("pp") / "store")


@pytest.fixture(scope="module")
def cache(store_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppc") / "pp"
    c, action = ensure_pp(store_path, out, PPSettings(OperatorSpec("sym"), hops=3), block_rows=37,
                          progress=False, log=None)
    assert action == "built"
    return c


pytestmark = pytest.mark.usefixtures("one_thread")


def settings(**kw) -> PPSettings:
    kw.setdefault("hops", 2)
    return PPSettings(OperatorSpec(kw.pop("op", "sym")), **kw)


# ---------------------------------------------------------------------------------------------------
# cache layout
# ---------------------------------------------------------------------------------------------------


def test_cache_rows_equal_propagation(cache, store_path) -> None:
    store = open_store(store_path)
    ref = propagate(store.indptr, store.indices, store.x, "sym", 3)
    rows = np.asarray(cache.rows)
    assert sorted(rows.tolist()) == list(range(N))  # all rows kept by default
    for r in range(4):
        np.testing.assert_allclose(cache.hop(r), ref[r][rows], rtol=1e-5, atol=1e-6)
        with open(cache.hop_path(r), "rb") as f:
            np.lib.format.read_magic(f)
            np.lib.format.read_array_header_1_0(f)
            assert f.tell() == ALIGN == cache.hop_offset(r)  # chunk-aligned data start
    np.testing.assert_array_equal(np.asarray(cache.y), np.asarray(store.y)[rows])


def test_split_major_order(cache, store_path) -> None:
    store = open_store(store_path)
    rows = np.asarray(cache.rows)
    for split in ("train", "val", "test"):
        a, b = cache.split_range(split)
        assert sorted(rows[a:b].tolist()) == sorted(store.split(split).tolist())
    a, b = cache.split_range("train")
    assert not np.all(np.diff(rows[a:b]) > 0), "training rows are shuffled once"
    np.testing.assert_array_equal(cache.rows_for_nodes(rows[[5, 250]]), [5, 250])


# ---------------------------------------------------------------------------------------------------
# every epoch yields every training row exactly once, in every mode
# ---------------------------------------------------------------------------------------------------


def node_ids(x: torch.Tensor) -> np.ndarray:
    return x[:, 0, 0].round().to(torch.int64).numpy()


def check_epochs(loader, cache, hops, expected_rows: np.ndarray, epochs: int = 2) -> list[np.ndarray]:
    orders = []
    y_all = np.asarray(cache.y)
    pos = {int(v): i for i, v in enumerate(np.asarray(cache.rows))}
    for ep in range(epochs):
        loader.set_epoch(ep)
        seen = []
        nb = 0
        for x, y in loader:
            nb += 1
            assert x.shape[1:] == (len(hops), F)
            ids = node_ids(x)
            crow = np.array([pos[i] for i in ids])
            for k, h in enumerate(hops):  # every hop slot holds that row of that hop
                np.testing.assert_allclose(x[:, k].numpy(), np.asarray(cache.hop(h))[crow], rtol=1e-6)
            np.testing.assert_array_equal(y.numpy(), y_all[crow])
            seen.append(ids)
        assert nb == len(loader)
        order = np.concatenate(seen)
        assert sorted(order.tolist()) == sorted(expected_rows.tolist()), f"epoch {ep} is not a permutation"
        orders.append(order)
    return orders


def train_nodes(cache) -> np.ndarray:
    a, b = cache.split_range("train")
    return np.asarray(cache.rows)[a:b]


@pytest.mark.parametrize("mode,chunk", [("index", 1), ("prefetch", 1), ("chunk", 1), ("chunk", 7), ("chunk", 32),
                                        ("storage", 1), ("storage", 5), ("storage", 32)])
def test_each_epoch_yields_every_training_row_once(cache, mode: str, chunk: int) -> None:
    hops = (0, 1, 3)
    rows = (0, cache.split_range("test")[1])
    train = cache.split_range("train")
    if mode == "storage":
        src = StorageSource(cache, hops, rows, min_read_bytes=0 if chunk > 1 else 1 << 16)
    else:
        src = MemorySource(cache, hops, rows)
    loader = PPLoader(src, 32, chunk_size=chunk, prefetch=mode != "index", seed=3, row_range=train, name=mode)
    orders = check_epochs(loader, cache, hops, train_nodes(cache))
    assert not np.array_equal(orders[0], orders[1]), "reshuffled between epochs"
    src.close()


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_naive_loaders_yield_every_row_once(cache, batch_sampler: bool) -> None:
    hops = (0, 2)
    src = MemorySource(cache, hops, (0, cache.split_range("test")[1]))
    loader = NaiveLoader(src, 48, batch_sampler=batch_sampler, row_range=cache.split_range("train"))
    check_epochs(loader, cache, hops, train_nodes(cache))


@pytest.mark.parametrize("budget,loader,placement", [("1G", "auto", "memory"), ("10KiB", "auto", "storage"),
                                                     ("1G", "naive", "memory"), ("1G", "storage", "storage")])
def test_ppdata_modes_and_eval(cache, budget: str, loader: str, placement: str) -> None:
    hops = (0, 1, 2, 3)
    pl = plan_placement(cache, hops, 16, loader=loader, memory_budget=budget)
    assert pl.placement == placement
    data = PPData(cache, hops, pl, 16, eval_batch_size=25)
    check_epochs(data.train, cache, hops, train_nodes(cache), epochs=1)
    for split in ("val", "test"):
        a, b = cache.split_range(split)
        ids = np.concatenate([node_ids(x) for x, _ in data.iter_split(split)])
        np.testing.assert_array_equal(ids, np.asarray(cache.rows)[a:b])  # evaluation is in order
    data.close()


def test_chunk_batch_is_zero_copy_view(cache) -> None:
    src = MemorySource(cache, (0, 1), (0, 200))
    loader = PPLoader(src, 20, chunk_size=20, row_range=(0, 200))
    x, _ = next(iter(loader))
    assert x.untyped_storage().data_ptr() == src.data.untyped_storage().data_ptr()


def test_prefetch_stops_when_consumer_breaks(cache) -> None:
    src = MemorySource(cache, (0,), (0, 200))
    loader = PPLoader(src, 8, prefetch=True, row_range=(0, 200))
    for _ in range(3):
        it = iter(loader)
        next(it)
        it.close()  # the generator's finally stops and joins the thread
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("trellis-prefetch")]


def test_epoch_batches_and_ranges() -> None:
    rng = np.random.default_rng(0)
    plan = epoch_batches(23, 10, 3, shuffle=True, rng=rng)
    assert [len(b) for b in plan] == [3, 3, 2]  # whole chunks, 3 per batch, 8 chunks
    assert sorted(np.concatenate(plan).tolist()) == list(range(8))
    np.testing.assert_array_equal(expand_ranges(np.array([5, 0, 9]), np.array([7, 1, 9])), [5, 6, 0])
    with pytest.raises(TrellisUserError, match="chunk-size"):
        PPLoader(MemorySource.__new__(MemorySource), 4, chunk_size=8)


# ---------------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------------


def test_placement_rules(cache) -> None:
    hops = (0, 1, 2, 3)
    data_bytes = 280 * 4 * F * 4
    pl = plan_placement(cache, hops, 16, memory_budget=10 * data_bytes)
    spare = (os.cpu_count() or 1) > torch.get_num_threads()  # a free core: prefetch can overlap
    assert (pl.placement, pl.chunk_size, pl.prefetch) == ("memory", 1, spare)
    assert pl.loader == ("prefetch" if spare else "index") and "fits" in pl.reason
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(os.cpu_count() or 1)
        assert plan_placement(cache, hops, 16, memory_budget="1G").loader == "index"
        assert plan_placement(cache, hops, 16, memory_budget="1G", device="meta").loader == "prefetch"
    finally:
        torch.set_num_threads(n)
    pl = plan_placement(cache, hops, 16, chunk_size=16, memory_budget=10 * data_bytes)
    assert (pl.loader, pl.chunk_size) == ("chunk", 16)
    pl = plan_placement(cache, hops, 16, memory_budget=data_bytes // 4)
    assert (pl.placement, pl.loader, pl.chunk_size) == ("storage", "storage", 16)
    assert "more than the budget" in pl.reason
    with pytest.raises(TrellisUserError, match="too small for one batch"):
        plan_placement(cache, hops, 16, memory_budget=16 * 4 * F * 4)
    with pytest.raises(TrellisUserError, match="--pp-loader index keeps"):
        plan_placement(cache, hops, 16, loader="index", memory_budget=data_bytes // 4)
    with pytest.raises(TrellisUserError, match="chunk-size applies"):
        plan_placement(cache, hops, 16, loader="index", chunk_size=4, memory_budget="1G")
    assert parse_size("2G") == 2 * 10**9 and parse_size("1.5MiB") == 3 * 2**19
    with pytest.raises(TrellisUserError):
        parse_size("lots")


def test_a_given_budget_caps_the_whole_process(cache) -> None:
    """``--memory-budget`` gave the rows the whole budget, as if the process took nothing itself (Cora: 250M asked,
    261 MiB peak RssAnon); the rows now get what the process's own memory and head-room leave, and the smallest
    budget that trains is named. Storage evaluation's buffers fit beside the training loader's."""
    hops, base = (0, 1, 2, 3), 100 * 2**20
    row = len(hops) * F * 4
    buffers = 2 * 17 * row  # a batch of 16 rows holds 17 (a last batch of one row joins the one before)
    need = base + PP_MARGIN_BYTES + buffers
    with pytest.raises(BudgetTooSmall, match="too small for one batch beside the process itself") as exc:
        plan_placement(cache, hops, 16, memory_budget=need - 1, baseline=base)
    assert exc.value.need == need and "the smallest budget is" in str(exc.value)
    pl = plan_placement(cache, hops, 16, memory_budget=need + 3 * row, baseline=base)
    assert pl.budget == buffers + 3 * row and pl.placement == "storage" and "less" in pl.budget_source
    data = PPData(cache, hops, pl, 16)
    try:
        assert data.eval_batch_size == 1  # 3 rows left: two eval buffers of one row each, beside training's
    finally:
        data.close()
    assert plan_placement(cache, hops, 16, memory_budget=need + 10 * 280 * row, baseline=base).placement == "memory"


# ---------------------------------------------------------------------------------------------------
# reuse, refusal, interrupted builds
# ---------------------------------------------------------------------------------------------------


def test_reuse_and_refusal(store_path, tmp_path) -> None:
    out = tmp_path / "pp"
    c1, a1 = ensure_pp(store_path, out, settings(), progress=False, log=None)
    mtime = (out / MARKER).stat().st_mtime_ns
    c2, a2 = ensure_pp(store_path, out, settings(), progress=False, log=None)
    assert (a1, a2) == ("built", "reused") and (out / MARKER).stat().st_mtime_ns == mtime
    with pytest.raises(TrellisUserError, match=r"other settings \(hops: 2 there vs 3 asked\)"):
        ensure_pp(store_path, out, settings(hops=3), progress=False, log=None)
    with pytest.raises(TrellisUserError, match="operator: 'sym' there vs 'ppr'"):
        ensure_pp(store_path, out, settings(op="ppr"), progress=False, log=None)
    other = make_store(tmp_path / "other", seed=0, shift=0.5)  # same graph, other features
    with pytest.raises(TrellisUserError, match="another store"):
        ensure_pp(other, out, settings(), progress=False, log=None)
    with pytest.raises(TrellisUserError, match="another store"):
        open_pp(out, open_store(other))
    c3, a3 = ensure_pp(other, out, settings(), overwrite=True, progress=False, log=None)
    assert a3 == "rebuilt" and c3.store_checksum == open_store(other).checksum
    with pytest.raises(TrellisUserError, match="graph store"):
        ensure_pp(store_path, store_path, settings(), overwrite=True, progress=False, log=None)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(TrellisUserError, match="not a pre-propagation cache"):
        ensure_pp(store_path, tmp_path / "junk", settings(), progress=False, log=None)


def test_split_rows_only(store_path, tmp_path) -> None:
    out = tmp_path / "pp"
    c, _ = ensure_pp(store_path, out, settings(split_rows_only=True), progress=False, log=None)
    assert c.num_rows == 280 and c.split_rows_only
    _, action = ensure_pp(store_path, out, settings(split_rows_only=None), progress=False, log=None)
    assert action == "reused"  # a pruned cache serves whoever does not insist on all rows
    with pytest.raises(TrellisUserError, match="only split rows"):
        ensure_pp(store_path, out, settings(split_rows_only=False), progress=False, log=None)
    missing = np.setdiff1d(np.arange(N), np.asarray(c.rows))[:1]
    with pytest.raises(TrellisUserError, match="--split-rows-only"):
        c.rows_for_nodes(missing)


def test_missing_marker_or_damage_is_redone(store_path, tmp_path) -> None:
    out = tmp_path / "pp"
    ensure_pp(store_path, out, settings(), progress=False, log=None)
    (out / MARKER).unlink()
    assert inspect_pp(out) == "incomplete"
    with pytest.raises(TrellisUserError, match="incomplete"):
        open_pp(out)
    logs: list[str] = []
    c, action = ensure_pp(store_path, out, settings(), progress=False, log=logs.append)
    assert action == "rebuilt" and inspect_pp(out) == "complete" and "interrupted" in logs[0]
    with open(out / "hop_2.npy", "r+b") as f:  # a truncated hop file
        f.truncate(ALIGN + 10)
    assert inspect_pp(out) == "incomplete"
    ensure_pp(store_path, out, settings(), progress=False, log=None)
    m = json.loads((out / "manifest.json").read_text())
    m["num_rows"] = 1  # the manifest no longer matches the marker
    (out / "manifest.json").write_text(json.dumps(m))
    assert inspect_pp(out) == "incomplete"


@pytest.mark.parametrize("damage", ["no labels", "truncated rows", "short labels"])
def test_a_cache_missing_or_damaging_its_rows_or_labels_is_incomplete(store_path, tmp_path, damage) -> None:
    """A cache without ``y.npy`` was called complete (and trained as unlabelled); a truncated ``rows.npy``
    passed too, and predict crashed on it with a traceback."""
    out = tmp_path / "pp"
    ensure_pp(store_path, out, settings(), progress=False, log=None)
    if damage == "no labels":
        (out / "y.npy").unlink()
    elif damage == "truncated rows":
        raw = (out / "rows.npy").read_bytes()
        (out / "rows.npy").write_bytes(raw[: len(raw) // 2])
    else:
        np.save(out / "y.npy", np.load(out / "y.npy")[:-1])
    assert inspect_pp(out) == "incomplete"
    with pytest.raises(TrellisUserError, match="incomplete"):
        open_pp(out)
    _, action = ensure_pp(store_path, out, settings(), progress=False, log=None)
    assert action == "rebuilt" and inspect_pp(out) == "complete"


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import trellis.loader.ppcache as ppc
    from trellis.data.store import open_store
    from trellis.ops.propagate import OperatorSpec
    real = ppc._write_rows
    def dying(path, *a, **k):
        real(path, *a, **k)
        if path.name == "hop_1.npy":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-build: no cleanup code runs
    ppc._write_rows = dying
    ppc.ensure_pp(open_store(sys.argv[1]), sys.argv[2], ppc.PPSettings(OperatorSpec("sym"), hops=2),
                  progress=False, log=None)
""")


def test_killed_preprocessing_is_detected_and_redone(store_path, tmp_path) -> None:
    out = tmp_path / "pp"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(store_path), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert inspect_pp(out) == "missing"  # nothing that looks like a cache
    leftovers = list(tmp_path.glob(".pp.pp-tmp-*"))
    assert leftovers and (leftovers[0] / "hop_1.npy").exists()  # the dead run's partial work
    with pytest.raises(TrellisUserError, match="no pre-propagated cache"):
        open_pp(out)
    c, action = ensure_pp(store_path, out, settings(), progress=False, log=None)
    assert action == "built" and inspect_pp(out) == "complete"
    assert not list(tmp_path.glob(".pp.pp-tmp-*")), "stale temporary directory of the dead run removed"
    ref = propagate(open_store(store_path).indptr, open_store(store_path).indices, open_store(store_path).x, "sym", 2)
    np.testing.assert_allclose(c.hop(2), ref[2][np.asarray(c.rows)], rtol=1e-5, atol=1e-6)


def test_feature_norm_row_is_applied_and_keyed(tmp_path) -> None:
    """Row L1 normalization before propagation; the cache is keyed on it (auto follows the store: none here)."""
    rng = np.random.default_rng(0)
    a = sp.random(50, 50, density=0.1, random_state=1, format="csr")
    x = rng.integers(0, 3, (50, 6)).astype(np.float32)
    x[7] = 0.0  # an all-zero row stays zero
    p = write_store(tmp_path / "bow", indptr=a.indptr, indices=a.indices, x=x, y=rng.integers(0, 2, 50),
                    splits={"train": np.arange(30), "val": np.arange(30, 40), "test": np.arange(40, 50)})
    assert open_store(p).preferred_feature_norm == "none"
    c, _ = ensure_pp(p, tmp_path / "pp", settings(feature_norm="row"), progress=False, log=None)
    assert c.feature_norm == "row"
    xn = x / np.maximum(np.abs(x).sum(1, keepdims=True), 1e-30)
    rows = np.asarray(c.rows)
    ref = propagate(a.indptr, a.indices, xn, "sym", 2)
    for r in range(3):
        np.testing.assert_allclose(c.hop(r), ref[r][rows], rtol=1e-5, atol=1e-7)
    assert ensure_pp(p, tmp_path / "pp", settings(feature_norm="row"), progress=False, log=None)[1] == "reused"
    with pytest.raises(TrellisUserError, match="feature_norm: 'row' there vs 'none' asked"):
        ensure_pp(p, tmp_path / "pp", settings(feature_norm="none"), progress=False, log=None)


def test_build_without_features_is_refused(tmp_path) -> None:
    p = write_store(tmp_path / "nofeat", indptr=np.array([0, 1, 2]), indices=np.array([1, 0]))
    with pytest.raises(TrellisUserError, match="no node features"):
        build_pp(open_store(p), tmp_path / "pp", settings(), progress=False, log=None)


def test_no_batch_of_one_row_and_every_row_once():
    """A last batch of one row crashed SIGN's batch normalization (200 training rows, --batch-size 199; or a rank
    whose share left one over); it joins the batch before, and the loader's length counts that."""
    from trellis.loader.pp import batches_per_epoch, epoch_batches

    rng = np.random.default_rng(0)
    for n in range(1, 40):
        for b in range(1, 12):
            for c in (1, 3):
                if c > b:
                    continue
                batches = epoch_batches(n, b, c, shuffle=True, rng=rng)
                assert len(batches) == batches_per_epoch(n, b, c)
                assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(-(-n // c)))
                if c == 1 and 1 < b < n:
                    assert min(x.shape[0] for x in batches) > 1
    assert [x.shape[0] for x in epoch_batches(200, 199, 1, shuffle=False, rng=None)] == [200]


def test_sign_trains_where_the_last_batch_would_hold_one_row(sbm_store, tmp_path):
    import trellis
    from trellis.data.store import GraphStore

    trellis.preprocess(sbm_store, tmp_path / "pp", hops=2)
    train = GraphStore(sbm_store).split("train").shape[0]
    run = trellis.train(sbm_store, strategy="pp", pp_dir=str(tmp_path / "pp"), model="sign", epochs=2,
                        batch_size=train - 1)
    assert len(run.history) == 2 and np.isfinite([r["loss"] for r in run.history]).all()
