"""``Comm.refuse_together``: ranks that check their own share of the input refuse it together, one of them says why.

Before it, a budget too small for some ranks' parts printed one line per rank with different numbers, and the
launcher added "rank r died: exit code 2".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trellis.distributed.comm import Comm, RankEnv, free_port
from trellis.errors import BudgetTooSmall, RankRefused, TrellisUserError
from trellis.train import launch

#: Per case: what each of two ranks' check does (None: passes and returns its rank; int: refuses needing so much;
#: "plain": refuses with a plain TrellisUserError).
CASES = {"none": (None, None), "one": (None, 5), "both": (20, 10), "plain": ("plain", "plain")}


def _worker(rank: int, world: int, port: int, case: str, out: str) -> None:
    comm = Comm(RankEnv(rank, world, rank, world, "127.0.0.1", port), torch.device("cpu"), 60.0)
    act = CASES[case][rank]

    def check() -> int:
        if act == "plain":
            raise TrellisUserError(f"plain refusal on rank {rank}")
        if act is not None:
            raise BudgetTooSmall(f"rank {rank} needs {act}", int(act))
        return rank

    try:
        got: dict = {"value": comm.refuse_together(check)}
    except RankRefused as exc:
        got = {"silent": str(exc)}
    except TrellisUserError as exc:
        got = {"speaks": str(exc)}
    finally:
        comm.close()
    Path(out, f"{case}-{rank}.json").write_text(json.dumps(got))


def test_the_rank_needing_most_speaks_and_the_others_refuse_silently(tmp_path):
    for case in CASES:
        mp.spawn(_worker, args=(2, free_port(), case, str(tmp_path)), nprocs=2, join=True)
    got = {(c, r): json.loads((tmp_path / f"{c}-{r}.json").read_text()) for c in CASES for r in (0, 1)}
    assert got[("none", 0)] == {"value": 0} and got[("none", 1)] == {"value": 1}
    # a rank whose own check passed refuses too: the job cannot run without its peer
    assert got[("one", 1)] == {"speaks": "rank 1 needs 5"}
    assert got[("one", 0)] == {"silent": "rank 1 refused the input (its error says why)"}
    assert got[("both", 0)] == {"speaks": "rank 0 needs 20"} and "silent" in got[("both", 1)]
    assert got[("plain", 0)] == {"speaks": "plain refusal on rank 0"} and "silent" in got[("plain", 1)]


def test_a_world_of_one_raises_its_own_error():
    comm = Comm(RankEnv(0, 1, 0, 1, "127.0.0.1", free_port()), torch.device("cpu"), 60.0)
    try:
        assert comm.refuse_together(lambda: 7) == 7
        with pytest.raises(BudgetTooSmall, match="need 3"):
            comm.refuse_together(lambda: (_ for _ in ()).throw(BudgetTooSmall("need 3", 3)))
    finally:
        comm.close()


def test_budget_too_small_survives_pickling():
    import pickle

    exc = pickle.loads(pickle.dumps(BudgetTooSmall("need 3 MiB", 3 << 20)))
    assert str(exc) == "need 3 MiB" and exc.need == 3 << 20


def _ranks(*codes_and_sleeps: tuple[int, float]) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({s}); sys.exit({c})"])
            for c, s in codes_and_sleeps]


def test_the_launcher_adds_no_line_when_the_ranks_refuse_together(capsys):
    assert launch._watch(_ranks((2, 0.0), (2, 0.5)), sys.stderr, []) == 2
    assert capsys.readouterr().err == ""


def test_a_rank_refusing_alone_is_named_after_the_others_had_their_time(capsys, monkeypatch):
    monkeypatch.setattr(launch, "REFUSE_WAIT_S", 0.3)
    procs = _ranks((2, 0.0), (0, 30.0))  # the other rank hangs (in a collective its peer never joins)
    assert launch._watch(procs, sys.stderr, []) == 2
    assert f"rank 0 (pid {procs[0].pid}) died: exit code 2; stopping the other ranks" in capsys.readouterr().err
    assert procs[1].poll() is not None  # stopped


def test_a_rank_that_handed_its_refusal_over_is_not_named(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "REFUSE_WAIT_S", 0.3)
    (tmp_path / "refused-0.txt").write_text("part 0 needs more")
    procs = _ranks((2, 0.0), (0, 30.0))
    assert launch._watch(procs, sys.stderr, [], tmp_path) == 2
    assert capsys.readouterr().err == "" and procs[1].poll() is not None


def test_ranks_whose_parts_exceed_the_budget_print_one_line(dist_store, layouts, tmp_path):
    """Both ranks of a buffered mini-batch job refused ``--memory-budget`` for their parts (two lines with their
    own numbers, then "rank r died: exit code 2"); now one line, the largest need, and nothing written."""
    out = tmp_path / "never"
    # above what the launcher itself takes (its preflight), below a rank's run with its parts (about 290 MiB)
    argv = [sys.executable, "-m", "trellis.cli", "train", str(dist_store), "--strategy", "mini", "--parts-dir",
            str(layouts[("metis", 4)]), "--nproc", "2", "--memory-budget", "240M", "--out", str(out),
            "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds less than one partition" in lines[0] and "smallest budget" in lines[0]
    assert not out.exists()
    # a Python caller gets the same words as an exception (it got RuntimeError "exit code 2")
    code = ("import trellis\n"
            "try:\n"
            f"    trellis.train({str(dist_store)!r}, strategy='mini', parts_dir={str(layouts[('metis', 4)])!r}, "
            f"nproc=2, memory_budget='240M', out={str(out)!r})\n"
            "except trellis.TrellisUserError as exc:\n"
            "    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: --memory-budget") and "holds less than one partition" in done.stdout
    assert "error" not in done.stderr  # said once, by the exception
    assert not out.exists()
