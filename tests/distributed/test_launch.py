"""The ``--nproc`` launcher and torchrun: bad input before any rank starts, a killed rank, resume, restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.train.helpers import wait_for_epochs
from trellis.cli.main import main

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
TRAIN = ("--epochs", "40", "--hidden", "8", "--checkpoint-every", "4", "--no-progress", "--timeout", "30")


def _records(run: Path) -> list[dict]:
    # timing, and the evaluation's bytes: a new process fetches the constant features' halo rows once more
    drop = ("time_s", "step_time_s", "compute_s", "comm_s", "eval_exchange_bytes")
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _ranks() -> list[psutil.Process]:
    """Running training ranks (processes of ``trellis.cli`` with a RANK variable)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("RANK") is not None and "trellis.cli" in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def _kill_rank(rank: int) -> int:
    """SIGKILL the running training rank ``rank``; returns its pid."""
    for p in _ranks():
        if p.environ().get("RANK") == str(rank):
            p.send_signal(signal.SIGKILL)
            return p.pid
    raise AssertionError(f"no rank {rank} running")


@pytest.fixture(scope="module")
def whole(dist_store, layouts, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank run through the launcher."""
    out = tmp_path_factory.mktemp("whole") / "run"
    rc = subprocess.run([sys.executable, "-m", "trellis.cli", "train", str(dist_store), "--parts-dir",
                         str(layouts[("metis", 2)]), "--out", str(out), *TRAIN], env=ENV,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert rc.returncode == 0, rc.stderr.decode()[-2000:]
    return out


def _peer_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("trellis-peer-*"))


def test_killed_rank_is_named_every_rank_exits_and_resume_finishes_the_run(dist_store, layouts, whole, tmp_path):
    out = tmp_path / "cut"
    peers = _peer_dirs()
    proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(dist_store), "--parts-dir",
                             str(layouts[("metis", 2)]), "--out", str(out), *TRAIN], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(out, proc, 10)
    pid = _kill_rank(1)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 30  # --timeout 30: nobody hangs
    assert proc.returncode != 0
    assert f"rank 1 (pid {pid}) died: killed by SIGKILL" in err.decode()
    assert not _ranks()  # every rank has exited
    assert _peer_dirs() <= peers  # the launcher removed the killed peer's scratch directory
    assert (out / "checkpoints" / "last.pt").is_file() and not (out / "summary.json").exists()
    rc = subprocess.run([sys.executable, "-m", "trellis.cli", "train", "--resume", str(out), "--no-progress"],
                        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert rc.returncode == 0, rc.stderr.decode()[-2000:]
    assert _records(out) == _records(whole)


def test_python_resume_of_a_run_over_ranks_restarts_its_ranks(dist_store, layouts, whole, tmp_path):
    """``trellis.resume`` trained an interrupted 2-rank run in one process (a world of one over a 2-part layout:
    a torch error in the halo routes); it starts the ranks again, as ``trellis train --resume`` does."""
    import trellis

    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(dist_store), "--parts-dir",
                             str(layouts[("metis", 2)]), "--out", str(out), *TRAIN], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(out, proc, 3)  # 37 epochs (about 0.7 s) left for the interrupt to arrive
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and (out / "checkpoints" / "last.pt").is_file(), (proc.returncode, err.decode())
    cut = len(_records(out))
    run = trellis.resume(out)
    assert _records(out) == _records(whole), f"cut after {cut} epochs"
    assert len(run.history) == len(_records(whole))


def test_torchrun_restart_resumes_from_the_checkpoint_by_itself(dist_store, layouts, whole, tmp_path):
    out = tmp_path / "elastic"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--log-dir", str(tmp_path / "elastic-logs"), "--max-restarts", "1", "-m", "trellis.cli",
                             "train", str(dist_store), "--parts-dir", str(layouts[("metis", 2)]), "--out", str(out),
                             *TRAIN], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(out, proc, 10)
    _kill_rank(1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert _records(out) == _records(whole)


def _bad(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(dist_store, layouts, tmp_path, capsys,
                                                                monkeypatch):
    from trellis.data.generate import generate_sbm

    parts = str(layouts[("metis", 2)])
    out = tmp_path / "never"
    base = ["train", str(dist_store), "--out", str(out), "--no-progress"]
    other = generate_sbm(tmp_path / "other", nodes=100, features=16, classes=4, seed=3, progress=False)
    assert "made from another store" in _bad(["train", str(other), "--parts-dir", parts, "--out", str(out)], capsys)
    assert "--parts 3" in _bad([*base, "--parts-dir", parts, "--nproc", "3"], capsys)
    assert "--model mlp is not available for cluster-batch across ranks" in _bad(
        [*base, "--parts-dir", parts, "--strategy", "cluster", "--model", "mlp", "--nproc", "2"], capsys)
    assert "--nproc needs --parts-dir" in _bad([*base, "--nproc", "2"], capsys)
    taken = tmp_path / "taken"  # a run directory: rank 0 refused it after the job had started (and rank 1 said so)
    (taken / "models").mkdir(parents=True)
    (taken / "config.json").write_text("{}")
    taken_argv = ["train", str(dist_store), "--out", str(taken), "--no-progress", "--parts-dir", parts]
    assert "run directory already exists" in _bad(taken_argv, capsys)
    assert "run directory already exists" in _bad([*taken_argv, "--strategy", "mini", "--nproc", "2"], capsys)
    assert "--staleness must be 0" in _bad([*base, "--parts-dir", parts, "--staleness", "-1"], capsys)
    for flag in (["--overlap"], ["--staleness", "1"], ["--emulate-link", "100MB/s"]):
        assert f"{flag[0]} applies to distributed runs only" in _bad([*base, *flag], capsys)
    assert "cannot read the rate" in _bad([*base, "--parts-dir", parts, "--emulate-link", "fast"], capsys)
    assert "cannot read the latency" in _bad([*base, "--parts-dir", parts, "--emulate-link", "1GB/s,soon"], capsys)
    assert "below what a rank process itself takes" in _bad([*base, "--parts-dir", parts, "--memory-budget", "20M"],
                                                            capsys)
    # refused before the ranks start (each rank had refused it, the line printed once per rank, then "rank 1 died")
    assert "--model gat cannot train under --memory-budget" in _bad(
        [*base, "--parts-dir", parts, "--memory-budget", "2G", "--model", "gat"], capsys)
    hashed = str(layouts[("hash", 2)])
    assert "--overlap splits each rank's pull graph" in _bad([*base, "--parts-dir", hashed, "--overlap"], capsys)
    assert "GPU" in _bad([*base, "--parts-dir", parts, "--device", "cuda"], capsys)  # NCCL: one GPU per rank
    with socket.socket() as s:  # a port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        assert "in use" in _bad([*base, "--parts-dir", parts], capsys)
    monkeypatch.delenv("MASTER_PORT")
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", parts, str(damaged)], check=True)
    target = damaged / "part-00001" / "indices.npy"
    arr = np.load(target)
    arr[0] = (arr[0] + 1) % 600
    np.save(target, arr)
    assert "sha256 does not match" in _bad([*base, "--parts-dir", str(damaged)], capsys)
    with open(target, "r+b") as f:  # a truncated array: its header promises more rows than the file holds
        f.truncate(200)
    assert "unreadable" in _bad([*base, "--parts-dir", str(damaged)], capsys)
    (damaged / "part-00001" / "indices.npy").unlink()
    assert "missing" in _bad([*base, "--parts-dir", str(damaged)], capsys)
    mini = [*base, "--parts-dir", parts, "--strategy", "mini", "--nproc", "2"]
    assert "--features none with --parts-dir" in _bad([*mini, "--features", "none"], capsys)
    assert "--features degree with --parts-dir" in _bad([*mini[:-4], "--strategy", "cluster", "--features", "degree"],
                                                        capsys)
    for timeout in ("0", "nan", "-1"):
        assert "--timeout must be a number of seconds >= 1" in _bad([*mini, f"--timeout={timeout}"], capsys)
    assert not out.exists()


def test_explain_describes_the_layout_and_the_plan_without_starting_ranks(dist_store, layouts, capsys):
    assert main(["train", str(dist_store), "--parts-dir", str(layouts[("hash", 4)]), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "distributed: 4 ranks over" in out and "src-owned: push exchange" in out
    assert "gcn[0]: pushdown=yes" in out and "exchange per layer at width 16" in out
    assert not _ranks()


def test_a_torchrun_mini_job_records_what_its_resume_needs(dist_store, layouts, tmp_path):
    """Rank 0 recorded nproc null for a torchrun job, which a mini-batch resume read as one process training every
    part through its buffer (another strategy, silently); and parts_dir as given (relative), which a resume from
    another directory did not find."""
    parts = layouts[("metis", 2)]
    rel = os.path.relpath(parts, tmp_path)
    rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "--log-dir", str(tmp_path / "elastic-logs"), "-m", "trellis.cli", "train", str(dist_store),
                         "--strategy", "mini", "--parts-dir", rel, "--out", "run", "--epochs", "1", "--hidden", "8",
                         "--no-progress"], env=ENV, cwd=tmp_path,
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert rc.returncode == 0, rc.stderr.decode()[-3000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["nproc"] == 2 and saved["parts_dir"] == str(Path(parts).resolve())


def test_a_torchrun_job_of_the_wrong_size_is_not_blamed_on_nproc(dist_store, layouts):
    """Under torchrun (no --nproc) each rank said `--nproc 3 does not match`, a flag the user never gave."""
    from trellis.data.store import GraphStore
    from trellis.errors import TrellisUserError
    from trellis.train.config import TrainConfig
    from trellis.train.strategies.partitioned import check_layout

    parts = str(layouts[("metis", 2)])
    with pytest.raises(TrellisUserError, match=r"^a job of 3 ranks \(WORLD_SIZE\) does not match the 2 parts.*start "
                                               r"2 ranks"):
        check_layout(TrainConfig(store=str(dist_store), parts_dir=parts), GraphStore(dist_store), 3)
    with pytest.raises(TrellisUserError, match=r"^--nproc 3 does not match the 2 parts.*pass --nproc 2"):
        check_layout(TrainConfig(store=str(dist_store), parts_dir=parts, nproc=3), GraphStore(dist_store), 3)


USER_SCRIPT = '''
import sys
import trellis
from trellis.nn import build_model


def my_gcn(in_dim, out_dim, hidden=8):
    return build_model("gcn", in_dim, out_dim, hidden=hidden)


if __name__ == "__main__":
    def under_main(in_dim, out_dim):
        return my_gcn(in_dim, out_dim)

    store, parts, out = sys.argv[1:4]
    try:
        trellis.train(store, model=under_main, epochs=2, parts_dir=parts, nproc=2, out=out + "-x")
    except trellis.TrellisUserError as exc:
        print("REFUSED", exc)
    run = trellis.train(store, model=my_gcn, epochs=2, parts_dir=parts, nproc=2, out=out)
    print("TRAINED", run.summary["model"], len(run.history))
'''


def test_a_python_callers_own_model_trains_on_ranks(dist_store, layouts, tmp_path):
    """``trellis.train(model=builder, nproc=2)``: every rank died with "--model 'my_gcn' is not one of ..." (a rank
    is a fresh ``python -m trellis.cli`` that never imported the caller's script). The ranks now import the
    builder by reference, the script under ``__mp_main__``; one defined under the main guard is refused first."""
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(dist_store), str(layouts[("metis", 2)]), str(out)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED model=under_main: under_main is defined under the script's `if __name__" in proc.stdout
    assert "TRAINED my_gcn 2" in proc.stdout
    assert json.loads((out / "config.json").read_text())["model"] == "my_gcn"
    assert not (tmp_path / "run-x").exists()


def test_a_builder_no_rank_can_import_is_refused_before_ranks_start():
    from trellis.errors import TrellisUserError
    from trellis.nn.models import MODELS, register_model
    from trellis.train.launch import USER_MODEL_ENV, import_user_model, user_model_env

    assert user_model_env("gcn") == {}

    def local_builder(in_dim, out_dim):
        raise AssertionError("not built")

    register_model("local_builder_t", local_builder)
    try:
        with pytest.raises(TrellisUserError, match="model=local_builder_t: the ranks are new processes and cannot "
                                                   "import a builder defined in a function"):
            user_model_env("local_builder_t")
    finally:
        MODELS.pop("local_builder_t", None)
    from tests.train.stubmodel import StubGNN  # an importable module's builder: found by module and name

    register_model("stub_t", StubGNN)
    try:
        env = user_model_env("stub_t")
        assert json.loads(env[USER_MODEL_ENV])["module"] == "tests.train.stubmodel"
        MODELS.pop("stub_t")
        os.environ[USER_MODEL_ENV] = env[USER_MODEL_ENV]
        import_user_model()  # what a rank does first
        assert getattr(MODELS["stub_t"], "__wrapped__", MODELS["stub_t"]) is StubGNN
    finally:
        os.environ.pop(USER_MODEL_ENV, None)
        MODELS.pop("stub_t", None)


def test_a_rank_that_ignores_the_forwarded_stop_is_stopped_once_the_others_exit(monkeypatch):
    """After a forwarded Ctrl-C the launcher waited for every rank with no deadline; a rank blocked in C++ (torch's
    TCPStore connecting to a rank 0 that had exited) kept the job alive for good."""
    import io

    from trellis.train import launch

    monkeypatch.setattr(launch, "STOP_WAIT_S", 0.5)
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time\nfor s in (signal.SIGINT, signal.SIGTERM):\n"
                              "    signal.signal(s, signal.SIG_IGN)\ntime.sleep(600)"])
    err = io.StringIO()
    t0 = time.monotonic()
    assert launch._watch([done, stuck], err, [signal.SIGINT]) == 130
    assert time.monotonic() - t0 < 30 and stuck.poll() is not None
    assert f"rank 1 (pid {stuck.pid}) did not stop within 0 s of the others" in err.getvalue()
