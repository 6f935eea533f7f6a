"""Every command of the README's tour runs as written, in order, in a fresh directory.

The ```bash block under "## Use" is split into commands (``\\`` continues a line, ``#`` starts a comment) and
each runs through bash in a new working directory with the installed ``trellis`` first on ``PATH`` and the
real datasets from ``TRELLIS_DATA_DIR``. A command that fails names its line: the README cannot drift from the
tool. Stores and run directories are made before they are used (the order is the README's).

The tour works on three stores, and no command reads what another store's commands made, so the commands run
as three chains side by side, each in the README's order (about 160 s instead of 320 s on 2 cores): a command
joins the chain of the store it names, or of the command before it when it names none (``trellis compare``).
A command that read another chain's output would fail here, not pass by luck.
"""

from __future__ import annotations

import os
import re
import signal
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


def chains(commands: list[str]) -> dict[str, list[tuple[int, str]]]:
    """The commands by the store they name (``stores/NAME``), numbered as in the README, each chain in order."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for i, cmd in enumerate(commands):
        named = set(re.findall(r"\bstores/([\w.-]+)", cmd))
        assert len(named) <= 1, f"README command {i} names two stores ({sorted(named)}): it joins no one chain"
        current = named.pop() if named else current
        if current is not None:
            out.setdefault(current, []).append((i, cmd))
    return out


def test_readme_tour_runs_in_order(tmp_path, data_dir):
    commands = readme_commands()
    assert len(commands) > 20 and commands[0].startswith("export TRELLIS_DATA_DIR")
    by_store = chains(commands)
    assert set(by_store) == {"cora", "computers", "sbm20k"}
    assert sorted(i for chain in by_store.values() for i, _ in chain) == list(range(1, len(commands)))
    env = {**os.environ, "TRELLIS_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    procs, logs = {}, {}
    try:
        for store, chain in by_store.items():  # output to files: a full pipe would stall a chain until read
            script = f"set -e\n{commands[0]}\n" + "".join(f"echo '>>> {i}'\n{cmd}\n" for i, cmd in chain)
            logs[store] = (tmp_path / f"{store}.out", tmp_path / f"{store}.err")
            with open(logs[store][0], "w") as out, open(logs[store][1], "w") as err:
                procs[store] = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=out,
                                                stderr=err, start_new_session=True)
        for store, proc in procs.items():
            proc.wait(timeout=1200)
            done = re.findall(r">>> (\d+)", logs[store][0].read_text())
            last = int(done[-1]) if done else -1
            assert proc.returncode == 0, (f"README command {last} failed: {commands[last]}\n"
                                          f"{logs[store][1].read_text().strip().splitlines()[-5:]}")
            assert last == by_store[store][-1][0]
    finally:
        for proc in procs.values():  # a failed chain ends the test: stop the others and their children
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for made in ("stores/cora", "runs/cora-gcn/summary.json", "preds.npy", "runs/sbm-ranks/summary.json",
                 "runs/sbm-buffer/summary.json", "runs/sbm-mini-ranks/summary.json",
                 "tunes/cora-gcn/best/config.json", "compare.png", "runs/computers-sign-2/summary.json"):
        assert (tmp_path / made).exists(), made
