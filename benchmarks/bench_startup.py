"""Start-up of a training process: Trellis's optimizers against torch's own, each in a fresh interpreter.

    python -m benchmarks.bench_startup [--pairs 5]

Each measurement is a fresh ``python`` that imports torch and trellis, builds a 2-layer model, and times
building the optimizer plus three steps (``zero_grad``, backward, ``step``) with the optimizer that
``trellis train`` builds (``build_optimizer("adam", ...)``) or with ``torch.optim.Adam``; the two alternate
``--pairs`` times. torch's optimizer imports ``torch._dynamo`` in its first call (about 1.9 s on 2 cores);
Trellis's does not while nothing has imported it. Prints each pair, the medians and their ratio.
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


def _seconds(which: str) -> tuple[float, bool]:
    done = subprocess.run([sys.executable, "-c", _CODE, which], capture_output=True, text=True, check=True)
    secs, dynamo = done.stdout.split()
    return float(secs), dynamo == "True"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args(argv)
    got: dict[str, list[float]] = {"trellis": [], "torch": []}
    for i in range(a.pairs):
        for name in ("trellis", "torch"):
            secs, dynamo = _seconds(name)
            got[name].append(secs)
            print(f"pair {i}: {name:7s} optimizer + 3 steps {secs:.3f} s (torch._dynamo imported: {dynamo})",
                  flush=True)
    ours, theirs = statistics.median(got["trellis"]), statistics.median(got["torch"])
    print(f"median: Trellis {ours:.3f} s, torch.optim.Adam {theirs:.3f} s; Trellis saves {theirs - ours:.2f} s "
          f"per process ({ours / theirs:.3f}x torch's time)")


if __name__ == "__main__":
    main()
