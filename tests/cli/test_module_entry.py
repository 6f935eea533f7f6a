from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
