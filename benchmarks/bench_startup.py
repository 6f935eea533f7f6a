"""Fixed costs of a process, each in a fresh interpreter: the optimizer's start-up, the curves plot, the help.

    python -m benchmarks.bench_startup [--pairs 5] [--only optimizer|curves|help]

Each measurement is a fresh ``python`` that imports torch and trellis, builds a 2-layer model, and times
building the optimizer plus three steps (``zero_grad``, backward, ``step``) with the optimizer that
``trellis train`` builds (``build_optimizer("adam", ...)``) or with ``torch.optim.Adam``; the two alternate
``--pairs`` times. torch's optimizer imports ``torch._dynamo`` in its first call (about 1.9 s on 2 cores);
Trellis's does not while nothing has imported it.

The curves: every ``trellis train`` ends by drawing its run's loss and metric curves. A fresh ``python`` that has
imported torch and trellis (as a finished run has) draws the curves of a 3-run, 200-epoch ``metrics.jsonl`` with
``trellis.train.runs.plot_curves`` (SVG text) or with matplotlib as Trellis did before (pyplot, two panels,
legends, a PNG at 100 dpi); the time includes importing what each needs.

The help screen: a fresh ``python`` prints ``trellis --help`` (imports included) as the command does now, the
other subcommands only listed, or with every subcommand's parser built, as it did before (``build_parser()``,
which imports every subcommand module and torch). Prints each pair, the medians, the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_CODE = """
import sys, time, torch
from trellis.train.optim import build_optimizer
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
x, y = torch.randn(256, 64), torch.randint(0, 8, (256,))
t = time.perf_counter()
if sys.argv[1] == "trellis":
    opt = build_optimizer("adam", model.parameters(), lr=0.01, weight_decay=5e-4)
else:
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print(time.perf_counter() - t, "torch._dynamo" in sys.modules)
"""


_CURVES = """
import json, math, os, sys, tempfile, time, torch
import trellis.train.runs as runs
d = tempfile.mkdtemp()
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for run in range(3):
        for e in range(200):
            acc = 0.8 * (1 - math.exp(-e / 30)) + 0.01 * run
            f.write(json.dumps({"run": run, "epoch": e, "loss": 2 * math.exp(-e / 50), "val_acc": acc,
                                "test_acc": acc - 0.02}) + "\\n")
t = time.perf_counter()
if sys.argv[1] == "trellis":
    runs.plot_curves(os.path.join(d, "metrics.jsonl"), os.path.join(d, "curves.svg"), "acc")
else:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_run = {}
    for rec in runs.iter_jsonl(os.path.join(d, "metrics.jsonl")):
        by_run.setdefault(rec["run"], []).append(rec)
    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4))
    for run, recs in sorted(by_run.items()):
        ep = [r["epoch"] for r in recs]
        ax_loss.plot(ep, [r["loss"] for r in recs], lw=1, label=f"run {run}")
        (line,) = ax_metric.plot(ep, [r["val_acc"] for r in recs], lw=1, label=f"val, run {run}")
        ax_metric.plot(ep, [r["test_acc"] for r in recs], lw=1, ls="--", color=line.get_color(),
                       label=f"test, run {run}")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    ax_metric.set(xlabel="epoch", ylabel="acc", title="acc (solid: val, dashed: test)")
    ax_loss.legend(fontsize=7)
    ax_metric.legend(fontsize=7)
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.12, top=0.92, wspace=0.22)
    fig.savefig(os.path.join(d, "curves.png"), format="png", dpi=100)
print(time.perf_counter() - t, "matplotlib" in sys.modules)
"""

_HELP = """
import contextlib, io, sys, time
t = time.perf_counter()
from trellis.cli.main import build_parser, main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    if sys.argv[1] == "trellis":
        main(["--help"])
    else:
        build_parser().parse_args(["--help"])
print(time.perf_counter() - t, "torch" in sys.modules)
"""

_CASES = {  # name: (code, what is timed, the competitor's name, what the flag printed means)
    "optimizer": (_CODE, "optimizer + 3 steps", "torch.optim.Adam", "torch._dynamo imported"),
    "curves": (_CURVES, "curves of 3 x 200 epochs", "matplotlib PNG", "matplotlib imported"),
    "help": (_HELP, "trellis --help", "every parser built", "torch imported"),
}


def _seconds(code: str, which: str) -> tuple[float, bool]:
    done = subprocess.run([sys.executable, "-c", code, which], capture_output=True, text=True, check=True)
    secs, flag = done.stdout.split()
    return float(secs), flag == "True"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--only", choices=sorted(_CASES), help="one measurement (default: all)")
    a = p.parse_args(argv)
    for case in [a.only] if a.only else list(_CASES):
        code, what, rival, flag = _CASES[case]
        got: dict[str, list[float]] = {"trellis": [], "rival": []}
        for i in range(a.pairs):
            for name in ("trellis", "rival"):
                secs, flagged = _seconds(code, name)
                got[name].append(secs)
                label = "Trellis" if name == "trellis" else rival
                print(f"pair {i}: {label:16s} {what} {secs:.3f} s ({flag}: {flagged})", flush=True)
        ours, theirs = statistics.median(got["trellis"]), statistics.median(got["rival"])
        print(f"median: Trellis {ours:.3f} s, {rival} {theirs:.3f} s; Trellis saves {theirs - ours:.2f} s "
              f"per process ({ours / theirs:.3f}x the other's time)\n")


if __name__ == "__main__":
    main()
