"""Counter-based dropout (``trellis.ops.dropout``) against torch's dropout and the kernel it replaced, same run.

    python -m benchmarks.bench_dropout [--rows 60000] [--widths 128,256] [--repeat 20]

A mini-batch's input block has tens of thousands of rows (SAGE 15,10 with 1,024 targets: ~120k); its
dropout mask is one hash per value. The previous kernel indexed ``x[start + c]`` inside each block and did
not vectorize; the current one works on per-block slices. Both give the same mask (checked here), so losses
are unchanged (``benchmarks/golden_losses.py``). Printed: milliseconds per call (median of ``--repeat``) for

* ``trellis``: the library's kernel (``trellis.ops.dropout.apply_``'s path);
* ``before``: the replaced kernel, kept below as the reference;
* ``torch``: ``torch.nn.functional.dropout`` (a sequential Bernoulli draw, different masks);

and the ratios.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import time_steps
from trellis.ops import dropout as D
from trellis.utils.numba import njit, prange


@njit(parallel=True, fastmath=True, nogil=True)
def _before(x, out, seed, threshold, scale):  # pragma: no cover - compiled
    """The kernel before the fix, verbatim: the same hash, indexed as x[i] (no vectorization)."""
    n = x.shape[0]
    block = 4096
    nblocks = (n + block - 1) // block
    for b in prange(nblocks):
        start = b * block
        stop = min(start + block, n)
        for i in range(start, stop):
            z = np.uint64(seed) + np.uint64(i) * D._M1
            z = (z ^ (z >> np.uint64(30))) * D._M2
            z = (z ^ (z >> np.uint64(27))) * D._M3
            z = z ^ (z >> np.uint64(31))
            if (z >> np.uint64(11)) < threshold:
                out[i] = 0.0
            else:
                out[i] = x[i] * scale


def _measure(rows: int, width: int, repeat: int) -> tuple[float, float, float]:
    """Milliseconds per call of the three kernels on a ``[rows, width]`` tensor; the two masks must agree."""
    threshold = np.uint64(int(0.5 * float(1 << 53)))
    x = torch.rand(rows, width)
    out, ref = torch.empty_like(x), torch.empty_like(x)
    flat, dref = x.view(-1).numpy(), ref.view(-1).numpy()
    ours = time_steps(lambda: D._run(x, 12345, 0.5, out=out), warmup=1, repeat=repeat) * 1e3
    before = time_steps(lambda: _before(flat, dref, np.uint64(12345), threshold, 2.0), warmup=1, repeat=repeat) * 1e3
    theirs = time_steps(lambda: torch.nn.functional.dropout(x, 0.5, True), warmup=1, repeat=repeat) * 1e3
    if not torch.equal(out, ref):
        raise SystemExit("the kernels' masks differ")
    return ours, before, theirs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=60000)
    p.add_argument("--widths", default="128,256")
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args(argv)
    print(f"torch threads {torch.get_num_threads()}; p = 0.5; ms per call (median of {a.repeat})")
    print(f"{'shape':>14} {'trellis':>9} {'before':>9} {'torch':>9} {'before/trellis':>15} {'torch/trellis':>14}")
    for width in (int(w) for w in a.widths.split(",")):
        ours, before, theirs = _measure(a.rows, width, a.repeat)
        print(f"{a.rows:>7} x {width:<4} {ours:9.2f} {before:9.2f} {theirs:9.2f} {before / ours:14.1f}x "
              f"{theirs / ours:13.1f}x")


if __name__ == "__main__":
    main()
