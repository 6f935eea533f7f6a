from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_python_dash_m_trellis_cli_runs_the_command():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "trellis.cli", "--help"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "usage: trellis" in proc.stdout and "sweep" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "trellis.cli", "data", "info", str(REPO / "no-such-store")], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "not a Trellis store" in proc.stderr


def test_help_and_data_info_do_not_import_torch(sbm_store):
    """``trellis --help``, an unknown command and ``trellis data info`` import neither torch nor the other
    subcommands (torch alone takes seconds); a named command's own help is complete."""
    code = ("import sys\nfrom trellis.cli.main import main\ncodes = []\n"
            "for a in [['--help'], ['bogus'], ['data', 'info', sys.argv[1]]]:\n"
            "    try:\n        codes.append(main(a))\n"
            "    except SystemExit as e:  # argparse's --help\n        codes.append(e.code)\n"
            "print(codes, 'torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('trellis.cli.')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, str(sbm_store)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    modules = "['trellis.cli.args', 'trellis.cli.commands', 'trellis.cli.data', 'trellis.cli.main']"
    assert last == f"[0, 2, 0] False {modules}", last
    assert "invalid choice: 'bogus'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "trellis.cli", "predict", "--help"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "--proba" in proc.stdout, proc.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_a_closed_output_pipe_is_named_as_such(sbm_store):
    """`trellis ... | head` ended in "error: Broken pipe (check the path, its permissions and the free space)"."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    proc = subprocess.run([sys.executable, "-m", "trellis.cli", "data", "info", str(sbm_store), "--json"],
                          env=_env(), stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    os.close(w)
    assert proc.returncode == 1 and "output pipe was closed by its reader" in proc.stderr, proc.stderr
    assert "check the path" not in proc.stderr and "Traceback" not in proc.stderr


def test_sigterm_to_a_sweep_removes_what_it_was_writing(sbm_store, tmp_path):
    """A SIGTERM killed `trellis sweep` at once (exit 143, no message) and left its hidden `.out.tmp-*` directory
    with the spills; it now unwinds like Ctrl-C."""
    import signal
    import time

    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "sweep", str(sbm_store), "--grid",
                             "lr=0.01,0.005", "--epochs", "100000", "--patience", "100000", "--no-progress", "--out",
                             str(out)], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".sweep.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert list(tmp_path.glob(".sweep.tmp-*")), "the sweep never started writing"
    time.sleep(2)  # into its epochs
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "interrupted" in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_inside_llvms_callback_still_unwinds_the_command(tmp_path, signame):
    """A SIGTERM while numba compiled (LLVM calling back into Python) was dropped with "Exception ignored on
    calling ctypes callback function"; the command then failed with numba's "no compiled object yet" (exit 1, a
    traceback) or ran on. The signal is now sent again once the callback has returned."""
    import time

    from tests.utils.test_signals import busy, llvm_callback
    from trellis.cli.main import Terminated, _SignalsUnwind

    raised = Terminated if signame == "SIGTERM" else KeyboardInterrupt
    callback = llvm_callback(tmp_path, f"    os.kill(os.getpid(), signal.{signame})\n" + busy(0.2))
    finished = []

    def command() -> None:  # compiles (the callback), then runs on: the signal must stop it
        callback()
        end = time.monotonic() + 5
        while time.monotonic() < end:
            time.sleep(0.01)
        finished.append(True)

    with pytest.raises(raised) as caught:
        _SignalsUnwind().run(command)
    assert isinstance(caught.value, Terminated) == (signame == "SIGTERM")
    assert not finished

    def failing() -> None:  # numba's failure after the dropped raise is reported as the signal
        callback()
        raise RuntimeError("no compiled object yet")

    with pytest.raises(raised):
        _SignalsUnwind().run(failing)
