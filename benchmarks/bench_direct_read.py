"""A partition buffer's part reads: one O_DIRECT read into the slot against the buffered read it replaced.

    python -m benchmarks.bench_direct_read --layout STORE/GREM16 [--parts 8] [--repeats 3]

For each of ``--parts`` parts of the layout, its ``x.npy`` is read into an aligned slot (the arena layout of
:class:`~trellis.loader.buffer.PartitionBuffer`) both ways, alternating, each from storage (the file's page cache is
dropped before every read): ``read_npy_direct`` and ``read_npy`` (buffered, then its cache pages dropped). Printed:
wall seconds and CPU seconds of the reading thread per part (medians), and their ratios; the two reads are checked
equal. The CPU time is what a reading thread takes from a trainer that shares its cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from trellis.loader.buffer import DIRECT_BLOCK, NPY_HEADER, direct_slot_stride, read_npy, read_npy_direct
from trellis.partition.layout import part_dir_name
from trellis.utils.spill import drop_file_cache


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True, help="a partitioned layout (trellis partition --out)")
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    layout = Path(a.layout)
    files = [layout / part_dir_name(k) / "x.npy" for k in range(a.parts)]
    shapes = [np.load(f, mmap_mode="r").shape for f in files]
    rows, dim = max(s[0] for s in shapes), int(np.prod(shapes[0][1:]))
    row_bytes = dim * 4
    stride = direct_slot_stride(rows, row_bytes)
    raw = np.empty(stride * row_bytes + 2 * DIRECT_BLOCK, dtype=np.uint8)
    first = (NPY_HEADER - raw.ctypes.data) % DIRECT_BLOCK + DIRECT_BLOCK
    slot = raw[first: first + stride * row_bytes].view(np.float32).reshape(stride, dim)
    got: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in ("direct", "buffered")}
    for r in range(a.repeats):
        for f, shape in zip(files, shapes, strict=True):
            out = slot[: shape[0]]
            seen = {}
            for mode in ("direct", "buffered") if r % 2 == 0 else ("buffered", "direct"):
                drop_file_cache(f)
                w0, c0 = time.perf_counter(), time.thread_time()
                if mode == "direct":
                    if not read_npy_direct(f, raw, first, out):
                        raise SystemExit(f"{f}: O_DIRECT refused here (file system?); nothing to compare")
                else:
                    read_npy(f, out)
                got[mode]["wall"].append(time.perf_counter() - w0)
                got[mode]["cpu"].append(time.thread_time() - c0)
                seen[mode] = out.copy()
            assert np.array_equal(seen["direct"], seen["buffered"]), f
    mb = statistics.median(np.prod(s) * 4 for s in shapes) / 2**20
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in got.items()}
    print(f"{a.parts} parts of {layout} (median {mb:.1f} MiB each), {a.repeats} repeats, alternating; from storage")
    print(f"{'read':>10} {'wall ms':>9} {'cpu ms':>8}")
    for m in ("direct", "buffered"):
        print(f"{m:>10} {med[m]['wall'] * 1e3:>9.1f} {med[m]['cpu'] * 1e3:>8.2f}")
    print(f"buffered / direct: wall {med['buffered']['wall'] / med['direct']['wall']:.2f}x, "
          f"cpu {med['buffered']['cpu'] / med['direct']['cpu']:.2f}x")
    print(json.dumps({"parts": a.parts, "repeats": a.repeats, "mib_per_part": mb, **med}))


if __name__ == "__main__":
    main()
