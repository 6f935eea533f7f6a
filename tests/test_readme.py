"""Every command of the README's tour runs as written, in order, in a fresh directory.

The ```bash block under "## Use" is split into commands (``\\`` continues a line, ``#`` starts a comment) and
each runs through bash in a new working directory with the installed ``trellis`` first on ``PATH`` and the
real datasets from ``TRELLIS_DATA_DIR``. A command that fails names its line: the README cannot drift from the
tool. Stores and run directories are made before they are used (the order is the README's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    use = text.split("## Use", 1)[1]
    block = re.search(r"```bash\n(.*?)```", use, re.S)
    assert block, "README: no ```bash block under ## Use"
    commands, current = [], ""
    for line in block.group(1).splitlines():
        line = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not line and not current:
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return [c for c in commands if c]


def test_readme_tour_runs_in_order(tmp_path, data_dir):
    commands = readme_commands()
    assert len(commands) > 20 and commands[0].startswith("export TRELLIS_DATA_DIR")
    env = {**os.environ, "TRELLIS_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    script = "set -e\n"
    for i, cmd in enumerate(commands):
        script += f"echo '>>> {i}'\n{cmd}\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    done = re.findall(r">>> (\d+)", proc.stdout)
    last = int(done[-1]) if done else -1
    assert proc.returncode == 0, (f"README command {last} failed: {commands[last]}\n"
                                  f"{proc.stderr.strip().splitlines()[-5:]}")
    assert last == len(commands) - 1
    for made in ("stores/cora", "runs/cora-gcn/summary.json", "preds.npy", "runs/sbm-ranks/summary.json",
                 "runs/sbm-buffer/summary.json", "runs/sbm-mini-ranks/summary.json",
                 "tunes/cora-gcn/best/config.json", "compare.png"):
        assert (tmp_path / made).exists(), made
