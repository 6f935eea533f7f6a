"""``trellis train --parts-dir PART_DIR --nproc P``: start P ranks on this machine and watch them.

Why not ``torch.multiprocessing.spawn``: a rank started here must be exactly what ``torchrun`` starts on a
cluster (``python -m trellis.cli train ...`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set), so the two paths cannot drift apart. The launcher:

* checks everything that can be refused before any rank starts (the layout, ``--nproc`` against its parts,
  enough GPUs for NCCL, the port), so bad input is one line and exit code 2;
* compiles the graph kernels once (numba's cache), so P ranks do not compile the same kernels at once;
* rendezvouses on 127.0.0.1 at a free port (bind port 0), or at ``MASTER_PORT`` when it is set;
* watches its children: on the first rank that dies it prints ``rank r (pid ...) died: ...``, stops the
  others (SIGTERM, then SIGKILL after a grace period) and exits non-zero — a dead rank never leaves the
  job hanging. SIGINT/SIGTERM to the launcher are passed on (the ranks checkpoint and stop together). A rank
  that refuses its share of the input (exit code 2, e.g. its part under ``--memory-budget``) hands its error
  to the launcher (:func:`~trellis.errors.report_to_launcher`), which raises it once, as bad input refused
  before the start is (the ranks refuse together: :meth:`~trellis.distributed.comm.Comm.refuse_together`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from trellis.data.store import GraphStore
from trellis.distributed.comm import RankEnv, free_port, rank_threads
from trellis.errors import REFUSAL_DIR_ENV, TrellisUserError, launcher_refusal
from trellis.train.config import TrainConfig
from trellis.train.runs import JOB_ENV, PEER_PREFIX, check_run_dir, default_run_dir
from trellis.train.strategies import strategy_class
from trellis.train.strategies.dist_mini import check_ranks
from trellis.train.strategies.dist_pp import check_pp_ranks
from trellis.train.strategies.partitioned import check_layout
from trellis.train.strategies.partitioned_outofcore import check_rank_model
from trellis.utils.memory import proc_status
from trellis.utils.sizes import format_size, parse_size
from trellis.utils.tempdirs import OwnedTempDir

#: Seconds the launcher waits for ranks to stop after SIGTERM before it kills them.
GRACE_S = 10.0
#: Seconds the other ranks get to exit by themselves once one has refused bad input (exit code 2): ranks that
#: refuse together (:meth:`~trellis.distributed.comm.Comm.refuse_together`) do, and one line says why.
REFUSE_WAIT_S = 10.0
#: Seconds the other ranks get to stop once one has exited after a forwarded Ctrl-C/SIGTERM.
STOP_WAIT_S = 60.0


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise TrellisUserError(f"MASTER_PORT={port} is in use on 127.0.0.1; unset MASTER_PORT (a free port is "
                                   "chosen) or pick another") from None


def preflight(cfg: TrainConfig) -> int:
    """Refuse bad input before any rank starts; returns the number of ranks to start."""
    cls = strategy_class(cfg.strategy).for_config(cfg)
    cls.check_options(cfg)
    if cfg.resume is None and cfg.out is not None:  # rank 0 refused it after the job had started
        check_run_dir(Path(str(cfg.out)), overwrite=bool(cfg.overwrite))
    store = GraphStore(str(cfg.store))
    if cfg.strategy in ("mini", "cluster"):  # batch training: --nproc ranks share the layout's parts
        nproc = int(cfg.nproc or 1)
        check_ranks(cfg, store, nproc)
    elif cfg.strategy == "pp":  # data-parallel over the cache's training rows
        nproc = int(cfg.nproc or 1)
        check_pp_ranks(cfg, nproc)
    else:
        layout = check_layout(cfg, store, None)
        nproc = cfg.nproc if cfg.nproc is not None else layout.num_parts
        check_layout(cfg, store, nproc)
    if cfg.memory_budget is not None:  # the exact minimum needs the rank's part and plan: each rank names it
        if cfg.strategy == "full":
            check_rank_model(cfg, store)
        budget = parse_size(cfg.memory_budget, flag="--memory-budget")
        base = proc_status().get("RssAnon", 0)  # this process has imported what a rank imports
        if budget < base:
            raise TrellisUserError(f"--memory-budget {cfg.memory_budget} per rank is below what a rank process "
                                   f"itself takes, about {format_size(base)} before its part and tiles; raise it "
                                   "(a rank names its exact minimum when it starts)")
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available()):
        have = torch.cuda.device_count()
        if have < nproc:
            raise TrellisUserError(f"--nproc {nproc} with NCCL needs one GPU per rank; {have} visible here (use "
                                   "--device cpu for gloo ranks, or fewer parts)")
    return nproc


def warm_kernels() -> None:
    """Compile (or load from numba's cache) the kernels every rank runs, once, before ranks start."""
    import numpy as np

    from trellis.ops import spmm
    from trellis.ops.dropout import dropout, keyed_rows
    from trellis.ops.graph import CSRGraph

    g = CSRGraph.from_numpy(np.array([0, 1, 2]), np.array([1, 0]))
    x = torch.ones(2, 2, requires_grad=True)
    spmm(g, x, torch.ones(2), self_weight=torch.ones(2)).sum().backward()
    with keyed_rows(nodes=np.arange(2)):
        dropout(torch.ones(2, 2), 0.5, True)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to SIGTERM this rank when the launcher dies (``PR_SET_PDEATHSIG``); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


#: Set to ``1`` in the ranks of a quiet launch: their trainers print no banner.
QUIET_ENV = "TRELLIS_QUIET"

#: Where a rank finds a user's model builder (``trellis.train(model=builder)``, ``register_model``): JSON of
#: its name, module, qualified name, the caller's script and ``sys.path``.
USER_MODEL_ENV = "TRELLIS_USER_MODEL"


def user_model_env(name: str) -> dict[str, str]:
    """The environment that lets a rank import the user's builder of model ``name`` ({} for a built-in).

    Why: a rank is a fresh ``python -m trellis.cli train`` process (what ``torchrun`` starts), which knows only
    the built-in models; a builder registered in the caller's process must be importable by reference, as
    ``multiprocessing``'s spawn imports the caller's script (under ``__mp_main__``: its ``if __name__ ==
    "__main__":`` block does not run again).

    Raises:
        TrellisUserError: A builder no other process can import (defined in a function or a notebook, a lambda).
    """
    from trellis.nn.models import MODELS, is_builtin

    if is_builtin(name) or name not in MODELS:
        return {}
    fn = getattr(MODELS[name], "__wrapped__", MODELS[name])
    module, qual = getattr(fn, "__module__", None), str(getattr(fn, "__qualname__", ""))
    main = getattr(sys.modules.get("__main__"), "__file__", None) if module == "__main__" else None
    if not module or "<" in qual or (module == "__main__" and main is None):
        where = ("an interactive session or notebook" if module == "__main__" and main is None
                 else "a function (or it is a lambda)")
        raise TrellisUserError(f"model={name}: the ranks are new processes and cannot import a builder defined in "
                               f"{where}; define it at the top level of a module or script (the script's run "
                               "under `if __name__ == \"__main__\":`), or start the ranks with torchrun running "
                               "your script")
    if main is not None and not _defined_outside_main_block(main, qual.split(".")[0]):
        raise TrellisUserError(f"model={name}: {qual} is defined under the script's `if __name__ == \"__main__\":`, "
                               "which the ranks do not run; define the builder at the script's top level")
    spec = {"name": name, "module": module, "qualname": qual, "main": main and os.path.abspath(main),
            "path": [p for p in sys.path if p]}
    return {USER_MODEL_ENV: json.dumps(spec)}


def _defined_outside_main_block(script: str, name: str) -> bool:
    """Whether ``script`` binds ``name`` at its top level, not under ``if __name__ == "__main__":``.

    A script that cannot be read or parsed is given the benefit of the doubt (the rank then names what fails).
    """
    import ast

    try:
        tree = ast.parse(Path(script).read_text())
    except (OSError, SyntaxError, ValueError):
        return True

    def main_guard(node: ast.stmt) -> bool:
        test = ast.unparse(node.test) if isinstance(node, ast.If) else ""
        return "__main__" in test and "__name__" in test

    def binds(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
                return True
            if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name.split(".")[0]) == name
                                                                     for a in node.names):
                return True
            if isinstance(node, ast.Assign | ast.AnnAssign) and any(
                    isinstance(t, ast.Name) and t.id == name
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                return True
            if isinstance(node, ast.If | ast.Try | ast.With) and not main_guard(node):
                inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                         *(s for h in getattr(node, "handlers", []) for s in h.body)]
                if binds(inner):
                    return True
        return False

    return binds(tree.body)


def import_user_model() -> None:
    """In a rank: register the user's builder named by :data:`USER_MODEL_ENV` (a no-op without it)."""
    import importlib
    import runpy
    import types

    from trellis.nn.models import register_model

    text = os.environ.get(USER_MODEL_ENV)
    if not text:
        return
    spec = json.loads(text)
    sys.path.extend(p for p in spec["path"] if p not in sys.path)
    try:
        if spec["main"]:  # the caller's script, its __main__ block not run (as multiprocessing's spawn does)
            mod = types.ModuleType("__mp_main__")
            mod.__dict__.update(runpy.run_path(spec["main"], run_name="__mp_main__"))
        else:
            mod = importlib.import_module(spec["module"])
        obj: Any = mod
        for part in spec["qualname"].split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure becomes one line
        raise TrellisUserError(f"model={spec['name']}: a rank could not import its builder "
                               f"{spec['module']}.{spec['qualname']} ({type(exc).__name__}: {exc})") from None
    register_model(spec["name"], obj)


def launch(cfg: TrainConfig, err: Any = None, *, quiet: bool = False) -> int:
    """Start ``--nproc`` ranks running ``cfg`` and wait for them; returns the job's exit code.

    ``quiet``: the ranks print no banner and their standard output (rank 0's summary lines) is dropped, for a
    library caller that reads the summary from the run directory; errors still reach ``err`` and the ranks'
    standard error.
    """
    err = err if err is not None else sys.stderr
    nproc = preflight(cfg)
    port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else free_port()
    _check_port(port)
    user = user_model_env(cfg.model)
    warm_kernels()
    values = cfg.to_dict(session=True)
    values["nproc"] = nproc
    total = nproc + int(getattr(cfg, "sampler_ranks", 0) or 0)  # trainers first, then the sampler ranks
    threads = rank_threads(total)
    procs: list[subprocess.Popen[bytes]] = []
    job = f"{os.getpid()}-{port}"
    # c10d's own log lines (a peer "failed to pass monitoredBarrier in 300000 ms" a second after it died) would
    # follow the launcher's one line naming the rank that died; a caller's TORCH_CPP_LOG_LEVEL is kept
    base = {"TORCH_CPP_LOG_LEVEL": "FATAL", **os.environ, JOB_ENV: job, "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(total), "LOCAL_WORLD_SIZE": str(total),
            "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}
    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # Signals reach only a process's main thread: a library caller's worker thread forwards none (the ranks still
    # die with this process, and a stop of the whole process reaches them through _die_with_parent).
    forwarding = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if forwarding else {}
    # the ranks' config and refusals; owned: a launcher killed with -9 leaves it only until the next launch
    # (utils/tempdirs.py)
    cfg_dir = OwnedTempDir("trellis-ranks-")
    base[REFUSAL_DIR_ENV] = cfg_dir.name
    cfg_file = Path(cfg_dir.name) / "config.json"
    try:
        cfg_file.write_text(json.dumps(values))
        for r in range(total):
            env = {**base, **user, "RANK": str(r), "LOCAL_RANK": str(r), **({QUIET_ENV: "1"} if quiet else {})}
            # Own session: a terminal's Ctrl-C reaches only the launcher, which passes it on once (two
            # SIGINTs would make a rank abort without its checkpoint); ranks die with the launcher.
            procs.append(subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", "--config", str(cfg_file)],
                                          env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                          stdout=subprocess.DEVNULL if quiet else None))
        code = _watch(procs, err, stopping, Path(cfg_dir.name))
        refusal = launcher_refusal(cfg_dir.name) if code == 2 else None
        if refusal is not None:
            raise refusal
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        cfg_dir.cleanup()
        for d in Path(tempfile.gettempdir()).glob(f"{PEER_PREFIX}{job}-*"):  # a killed peer's scratch directory
            shutil.rmtree(d, ignore_errors=True)


def needs_launch(cfg: TrainConfig) -> bool:
    """Whether training ``cfg`` here starts ranks: ``--parts-dir`` outside a rank (full unless ``--nproc 1``).

    Mini- and cluster-batch start ranks only when ``--nproc`` > 1 (one process trains every part through its
    buffer), and pre-propagation (``--strategy pp --nproc P``, no layout: the ranks split the cache's rows) too. A
    process started by ``torchrun`` (or by :func:`launch`) is a rank and trains its part itself; so is a world
    of one, which needs no launcher.
    """
    if RankEnv.from_environ() is not None:
        return False
    if cfg.strategy == "pp":  # data-parallel over rows: no layout
        return (cfg.nproc or 1) > 1
    if cfg.parts_dir is None:
        return False
    if cfg.strategy in ("mini", "cluster"):  # one process trains every part through its buffer unless --nproc says
        return (cfg.nproc or 1) > 1
    return cfg.strategy == "full" and (cfg.nproc or 0) != 1


def train_ranks(cfg: TrainConfig, err: Any = None, *, quiet: bool = False) -> dict[str, Any]:
    """Start the ranks of ``cfg`` on this machine, wait for them and return the job's summary.

    The library's counterpart of ``trellis train --parts-dir PART_DIR --nproc P``: the same launcher, and the
    summary rank 0 wrote (the one a single process's :func:`trellis.train.trainer.train` returns).

    Raises:
        TrellisUserError: Bad input, refused before any rank starts.
        RuntimeError: A rank died or the job was interrupted (the message names the exit code).
    """
    if cfg.out is None:  # the ranks must agree on the run directory, and the caller must find it
        cfg = dataclasses.replace(cfg, out=str(default_run_dir(Path(str(cfg.store)).name, cfg.model)))
    code = launch(cfg, err, quiet=quiet)
    if code != 0:
        started = Path(str(cfg.out), "config.json").is_file()  # rank 0 wrote the run directory: it can resume
        raise RuntimeError(f"the distributed run in {cfg.out} stopped with exit code {code}"
                           + (f"; continue it with resume={cfg.out!r}" if started else
                              " before rank 0 wrote its run directory (the ranks' errors are above)"))
    return dict(json.loads(Path(str(cfg.out), "summary.json").read_text()))


def _watch(procs: list[subprocess.Popen[bytes]], err: Any, stopping: list[int], refusals: Path | None = None) -> int:
    """Wait for every rank; on the first failure name it, stop the rest and return non-zero.

    A rank that refused bad input (exit code 2) is not named when it handed its refusal to the launcher
    (a ``refused-<rank>.txt`` in ``refusals``, which the caller raises) or when every rank refused.

    After the launcher passed on SIGINT/SIGTERM (``stopping``), ranks exit 128 + signal once they have
    checkpointed together: that is waited for, not treated as a death. But once one rank has exited, the rest
    get :data:`STOP_WAIT_S`: a rank still starting up can be blocked in C++ connecting to a rank 0 that is gone
    (torch's TCPStore), where no signal reaches it, and the launcher waited for it for good.
    """
    first_exit: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return next((c if c > 0 else 128 - c for c in codes if c), 0)
        if stopping and any(c is not None for c in codes):
            first_exit = first_exit if first_exit is not None else time.monotonic()
            if time.monotonic() - first_exit > STOP_WAIT_S:
                late = [r for r, c in enumerate(codes) if c is None]
                print(f"rank {late[0]} (pid {procs[late[0]].pid}) did not stop within {STOP_WAIT_S:.0f} s of the "
                      "others; stopping it", file=err, flush=True)
                _stop(procs)
                return 128 + stopping[0]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and not stopping:
            r = failed[0]
            code = codes[r]
            assert code is not None
            if code == 2:  # bad input, printed by the rank(s): the others refuse it too and exit by themselves
                first_exit = first_exit if first_exit is not None else time.monotonic()
                if any(c is None for c in codes) and time.monotonic() - first_exit < REFUSE_WAIT_S:
                    time.sleep(0.05)
                    continue
                if all(c in (0, 2) for c in codes) or (refusals is not None and launcher_refusal(refusals)):
                    _stop(procs)
                    return 2
            print(f"rank {r} (pid {procs[r].pid}) died: {_describe(code)}; stopping the other ranks",
                  file=err, flush=True)
            _stop(procs)
            return code if code > 0 else 128 - code
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
