"""Torch's OpenMP threads spinning or sleeping between ops: a training step under each ``OMP_WAIT_POLICY``.

    python -m benchmarks.bench_omp_wait --store STORE [--pairs 3] [--epochs 40] [-- trellis train flags]

Runs ``trellis train STORE --model gcn --hidden 256`` (or the flags after ``--``) in fresh processes, one after
another, alternating ``unset`` (GNU OpenMP's default: spin a while, then sleep) and ``PASSIVE`` (sleep at once),
``--pairs`` times; prints each run's median training step and the means. ``import trellis`` sets ``PASSIVE`` on
machines of up to 4 cores when the variable is unset, so the ``unset`` runs import torch before trellis (which
then leaves OpenMP alone) and call the same command entry.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile


def _step_ms(store: str, out: str, policy: str | None, extra: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    argv = ["train", store, "--device", "cpu", "--checkpoint-every", "0", "--no-progress", "--out", out,
            "--overwrite", *extra]
    if policy is None:  # torch first: trellis then leaves OMP_WAIT_POLICY unset (GNU OpenMP's own default)
        code = f"import sys, torch; from trellis.cli.main import entry; sys.argv = ['trellis', *{argv!r}]; entry()"
        cmd = [sys.executable, "-c", code]
    else:
        env["OMP_WAIT_POLICY"] = policy
        cmd = [sys.executable, "-m", "trellis.cli", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    m = re.search(r"training step ([\d.]+) ms", text)
    if m is None:
        raise RuntimeError(f"no step time in: {text[-500:]}")
    return float(m.group(1))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=40)
    a = p.parse_args(args)
    flags = extra or ["--model", "gcn", "--hidden", "256"]
    flags = [*flags, "--epochs", str(a.epochs)]
    got: dict[str, list[float]] = {"unset": [], "PASSIVE": []}
    with tempfile.TemporaryDirectory(prefix="trellis-bench-omp-") as tmp:
        for i in range(a.pairs):
            for name, policy in (("unset", None), ("PASSIVE", "PASSIVE")):
                ms = _step_ms(a.store, f"{tmp}/{name}-{i}", policy, flags)
                got[name].append(ms)
                print(f"pair {i}: {name:8s} {ms:.1f} ms per step", flush=True)
    for name, vals in got.items():
        print(f"{name:8s} mean {statistics.mean(vals):.1f} ms ({', '.join(f'{v:.1f}' for v in vals)})")
    print(f"PASSIVE / unset: {statistics.mean(got['PASSIVE']) / statistics.mean(got['unset']):.2f}x")


if __name__ == "__main__":
    main()
