import json
import re
import shutil

import numpy as np
import pytest

from trellis.cli.main import main
from trellis.data.store import write_store
from trellis.partition import open_partitioned


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 400
    src, dst = rng.integers(0, n, 3000), rng.integers(0, n, 3000)
    src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    path = tmp_path_factory.mktemp("cli") / "store"
    write_store(path, indptr=indptr, indices=src[order], x=rng.random((n, 4)), y=rng.integers(0, 3, n))
    return path


def run(argv, capsys):
    rc = main(["partition", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_report_and_layout(store_path, tmp_path, capsys):
    out_dir = tmp_path / "parts"
    rc, out, _ = run([store_path, "--parts", 4, "--method", "grem", "--out", out_dir, "--json",
                      "--chunk-frac", 0.2, "--seed", 3], capsys)
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    for key in ("edge_cut_frac", "balance", "time_s", "peak_rss_mb", "peak_rss_anon_mb", "replication_factor",
                "exchange_fwd_bytes", "exchange_bwd_bytes", "part_halo"):
        assert key in report
    assert 0 <= report["edge_cut_frac"] <= 1 and report["balance"] <= 1.05 + 1e-9
    assert report["params"]["chunk_frac"] == 0.2 and report["params"]["seed"] == 3
    pg = open_partitioned(out_dir, verify=True)
    assert pg.num_parts == 4 and (out_dir / "node_parts.npy").is_file()


def test_table_output(store_path, tmp_path, capsys):
    rc, out, _ = run([store_path, "-p", 2, "-m", "metis", "-o", tmp_path / "p"], capsys)
    assert rc == 0 and "edge cut" in out and "halo" in out and "layout written" in out


@pytest.mark.parametrize("method,extra", [("hash", []), ("vertex-cut", []), ("reverse", []), ("ldg", []),
                                          ("grem", ["--no-refine", "--chunk-edges", 500, "--seed-method", "ldg"])])
def test_methods_and_options(store_path, tmp_path, capsys, method, extra):
    rc, out, _ = run([store_path, "-p", 3, "-m", method, "--no-layout", "--json", *extra], capsys)
    assert rc == 0
    report = json.loads(out)
    assert report["method"] == method and report["num_parts"] == 3


@pytest.mark.parametrize("argv,message", [
    (["--parts", 0], "--parts must be at least 1"),
    (["--parts", 401], "exceeds the graph's 400 nodes"),
    (["--parts", 2, "--method", "spectral"], "unknown partitioning method 'spectral'"),
    (["--parts", 2, "--chunk-frac", 0], r"--chunk-frac must be in \(0, 1\]"),
    (["--parts", 2, "--chunk-frac", 1.5], r"--chunk-frac must be in \(0, 1\]"),
    (["--parts", 2, "--chunk-frac", -0.1], r"--chunk-frac must be in \(0, 1\]"),
    (["--parts", 2, "--chunk-frac", 0.1, "--chunk-edges", 5], "not allowed with"),
    (["--parts", 2, "--method", "metis", "--no-refine"], "--no-refine does not apply to --method metis"),
    (["--parts", 2, "--seed-method", "spectral"], "--seed-method must be one of"),
    (["--parts", "two"], "invalid int value"),
    (["--parts", 2, "--seed=-1"], "--seed: -1 must be >= 0"),
    (["--parts", 2, "--seed", "-1"], "--seed: -1 must be >= 0"),  # a value after its flag, starting with -
])
def test_bad_input_exits_2_and_writes_nothing(store_path, tmp_path, capsys, argv, message):
    out_dir = tmp_path / "parts"
    rc, out, err = run([store_path, *argv, "--out", out_dir], capsys)
    assert rc == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1  # one line, no traceback
    assert re.search(message, err), err
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


def test_store_failing_its_manifest_check(store_path, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(store_path, bad)
    indices = np.load(bad / "indices.npy")
    indices[0] = (indices[0] + 1) % 400
    np.save(bad / "indices.npy", indices)
    rc, _, err = run([bad, "--parts", 2, "--out", tmp_path / "parts"], capsys)
    assert rc == 2 and "sha256" in err
    rc, _, err = run([tmp_path / "missing", "--parts", 2, "--out", tmp_path / "parts"], capsys)
    assert rc == 2 and "not a Trellis store" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_existing_output_needs_overwrite(store_path, tmp_path, capsys):
    out_dir = tmp_path / "parts"
    assert run([store_path, "-p", 2, "-m", "hash", "-o", out_dir], capsys)[0] == 0
    rc, _, err = run([store_path, "-p", 2, "-m", "hash", "-o", out_dir], capsys)
    assert rc == 2 and "already exists" in err
    assert run([store_path, "-p", 3, "-m", "hash", "-o", out_dir, "--overwrite"], capsys)[0] == 0
    assert open_partitioned(out_dir).num_parts == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parts"]


def test_out_required_unless_no_layout(store_path, capsys):
    rc, _, err = run([store_path, "-p", 2], capsys)
    assert rc == 2 and "--out" in err
