"""Building a partition buffer state's sampling graph: own sources taken without a look-up, against the look-up.

    python -m benchmarks.bench_state_graph --layout PART_DIR [--parts 4] [--repeats 5]

For each of the first ``--parts`` parts of a layout, the graph of a state holding that part alone
(:class:`trellis.loader.buffer.StateGraphs`) is built two ways, interleaved: as the buffer builds it now (the
part's layout-local source ids tell its own rows apart, no store edge ids without edge data) and as it did
before (every source's availability looked up, store edge ids written). The run checks that both give the
same graph and prints the median milliseconds and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from trellis.loader.buffer import PartitionBuffer, PartRows, StateGraphs
from trellis.partition.layout import PartitionedGraph


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", required=True)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    layout = PartitionedGraph(Path(a.layout))
    n = layout.num_nodes
    buf = PartitionBuffer(layout, 1, [10, 5], np.zeros(0, dtype=np.int64), 1024, y=None,
                          degree=np.ones(n, dtype=np.float32))
    builder = StateGraphs(n)
    now_ms: list[float] = []
    before_ms: list[float] = []
    try:
        for part in range(min(a.parts, layout.num_parts)):
            piece = buf.read_edges(part)
            before = PartRows(part, piece.rows, piece.indptr, piece.src, np.zeros(piece.src.shape[0], np.int64))
            avail = np.zeros(n, dtype=bool)
            avail[piece.rows] = True
            ip_b, ix_b = (np.array(x) for x in builder.build([before], avail, avail)[:2])
            ip_n, ix_n = builder.build([piece], avail, avail)[:2]
            if not (np.array_equal(ip_b, ip_n) and np.array_equal(ix_b, ix_n)):
                raise SystemExit(f"part {part}: the two builds differ")
            for _ in range(a.repeats):
                for pieces, out in (([piece], now_ms), ([before], before_ms)):
                    t0 = time.perf_counter()
                    builder.build(pieces, avail, avail)
                    out.append(1e3 * (time.perf_counter() - t0))
    finally:
        buf.close()
    now, old = statistics.median(now_ms), statistics.median(before_ms)
    print(f"state graph, one part resident ({n:,} nodes, {layout.num_parts} parts): now {now:.2f} ms, "
          f"look-up of every source {old:.2f} ms ({old / now:.2f}x)")
    print(json.dumps({"now_ms": now, "lookup_ms": old}))


if __name__ == "__main__":
    main()
