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
