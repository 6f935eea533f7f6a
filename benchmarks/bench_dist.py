"""Partition-parallel training: measured against the cost model here, and extrapolated to 16 machines.

    python -m benchmarks.bench_dist [--nodes 200k] [--procs 1,2,4] [--methods grem,hash-dst] [--epochs 10]
    python -m benchmarks.bench_dist --save result.json ...          # keep the measurement for later
    python -m benchmarks.bench_dist --extrapolate-from result.json  # only the 16-machine table

Two tables (markdown, pasteable into docs/distributed.md):

1. **Scaling on this machine** (what ``python -m benchmarks.scaling --predict`` prints, :mod:`benchmarks.scaling`):
   on a generated SBM graph, the single process, then ``trellis train --parts-dir`` at each P for each
   partitioner (every run its own process), with the step time the cost model (:mod:`trellis.plan.rank_cost`)
   predicts from the P = 1 step, the layouts' per-part counts and the loopback gloo all-to-all's measured
   bandwidth and latency. Bytes and per-rank peak ``RssAnon`` come from the run directories.
2. **16 machines, 100M nodes**: the same model with the serial work per (edge + node) and the thread
   efficiency measured in (1), the exchange shape (floats per halo row, exchanges per step) of (1)'s
   model, and the halo sizes and balance of 16-part partitions of generated SBM and R-MAT graphs
   (``--cut-nodes`` nodes, GREM, METIS and hash-dst, measured here by ``trellis partition --no-layout``)
   scaled to ``--target-nodes``. Links of 100 Gb/s and 10 Gb/s at their line rate; ``--cores`` per
   machine, one rank per machine.

Every figure of (2) is a prediction: nothing here runs on 16 machines. Its assumptions are the cost
model's (no overlap, compute linear in edges + nodes + halo rows, full bisection bandwidth) plus two of
scale: the halo per node of a 16-part partition does not change between ``--cut-nodes`` and 100M nodes,
and the thread efficiency measured on this machine's cores holds on ``--cores``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.scaling import ScalingConfig, format_rows, generate, partition, run_scaling
from trellis.plan.rank_cost import CostInputs, halo_sent_bytes, predict, work_shares

#: Links of the extrapolation: label -> (bytes/s, seconds per message).
LINKS = {"100 Gb/s": (100e9 / 8, 10e-6), "10 Gb/s": (10e9 / 8, 50e-6)}


def parse_count(text: str) -> int:
    """``"200k"`` -> 200000, ``"1.5m"`` -> 1500000, ``"1000"`` -> 1000 (decimal suffixes k, m, g)."""
    t = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def measure_cuts(generators: list[str], methods: list[str], nodes: int, avg_degree: float, parts: int,
                 work: Path) -> list[dict[str, Any]]:
    """Quality reports of ``parts``-part partitions of generated graphs (no layouts written)."""
    out = []
    for gen in generators:
        cfg = ScalingConfig(generator=gen, nodes=nodes, avg_degree=avg_degree, features=0, classes=8)
        store = work / f"cut-{gen}-{nodes}"
        if not (store / "manifest.json").exists():
            generate(cfg, store)
        for method in methods:
            q = partition(store, parts, method, None)
            q["graph"] = gen
            out.append(q)
            print(f"{gen} {nodes:,} nodes, {method} P={parts}: cut {100 * q['edge_cut_frac']:.1f}%, "
                  f"halo {sum(q['part_halo']) / q['num_nodes']:.2f} rows per node, balance {q['balance']:.3f}",
                  flush=True)
    return out


def extrapolate(result: dict[str, Any], cuts: list[dict[str, Any]], *, target_nodes: int, machines: int,
                cores: int) -> list[dict[str, Any]]:
    """Predicted step of ``machines`` machines (one rank each) on a ``target_nodes`` graph, per cut and link."""
    m, c = result["machine"], result["config"]
    unit_s = m["serial_step_s"] / m["work_units"]  # serial seconds per (edge + node_weight * node)
    node_weight = float(c.get("node_weight", 1.0))
    halo_weight = float(c.get("halo_weight", 1.0))
    rows = []
    for q in cuts:
        scale = target_nodes / q["num_nodes"]
        edges = q["num_edges"] * scale
        total = edges + node_weight * target_nodes
        part_edges = [e * scale for e in q["part_edges"]]
        part_nodes = [n * scale for n in q["part_nodes"]]
        part_halo = [h * scale for h in q["part_halo"]]
        work = work_shares(part_edges, part_nodes, part_halo, node_weight=node_weight, halo_weight=halo_weight)
        sent = halo_sent_bytes(part_halo, float(m["row_floats"]))
        one = predict(CostInputs(ranks=1, compute_s=unit_s * total, thread_efficiency=m["thread_efficiency"],
                                 cores=cores))
        for link, (bw, lat) in LINKS.items():
            out = predict(CostInputs(ranks=q["num_parts"], compute_s=unit_s * total,
                                     thread_efficiency=m["thread_efficiency"], work=work, total_work=total,
                                     sent_bytes=sent, exchanges=int(m["exchanges"]), bandwidth=bw, latency_s=lat,
                                     cores=cores, machines=machines, allreduces=2,
                                     allreduce_bytes=4.0 * m["num_parameters"]))
            rows.append({"graph": q["graph"], "partitioner": q["method"],
                         "cut %": f"{100 * q['edge_cut_frac']:.1f}",
                         "halo rows/node": f"{sum(q['part_halo']) / q['num_nodes']:.2f}",
                         "link": link, "GB sent/step (max rank)": f"{max(sent) / 1e9:.2f}",
                         "compute s": f"{out.compute_s:.2f}", "comm s": f"{out.comm_s:.2f}",
                         "step s": f"{out.total_s:.2f}", "comm share": f"{out.comm_s / out.total_s:.0%}",
                         "vs 1 machine": f"{one.total_s / out.total_s:.1f}x"})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="200k", help="scaling graph size, k/m suffixes (default: %(default)s)")
    p.add_argument("--procs", default="1,2,4", help="rank counts (default: %(default)s)")
    p.add_argument("--methods", default="grem,hash-dst", help="partitioners of the scaling runs (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=10, help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--features", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="(default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="stores, layouts, runs (default: a temp dir)")
    p.add_argument("--save", type=Path, default=None, help="write the scaling result (JSON) here")
    p.add_argument("--extrapolate-from", type=Path, default=None,
                   help="skip the scaling runs: extrapolate from a saved result (--save, or "
                        "`python -m benchmarks.scaling --predict --json`)")
    p.add_argument("--no-extrapolate", action="store_true", help="only the scaling table")
    p.add_argument("--cut-nodes", default=None, help="size of the graphs partitioned into 16 parts for the "
                                                     "extrapolation (default: --nodes)")
    p.add_argument("--cut-methods", default="grem,metis,hash-dst", help="(default: %(default)s)")
    p.add_argument("--cut-graphs", default="sbm,rmat", help="(default: %(default)s)")
    p.add_argument("--target-nodes", default="100m", help="extrapolated graph size (default: %(default)s)")
    p.add_argument("--machines", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--cores", type=int, default=32,
                   help="cores per machine of the extrapolation (default: %(default)s)")
    a = p.parse_args()
    print("$ python -m benchmarks.bench_dist " + " ".join(shlex.quote(x) for x in sys.argv[1:]), flush=True)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="trellis-bench-dist-"))
    if a.extrapolate_from is not None:
        result = json.loads(a.extrapolate_from.read_text())
    else:
        cfg = ScalingConfig(nodes=parse_count(a.nodes), avg_degree=a.avg_degree, features=a.features,
                            methods=tuple(a.methods.split(",")), procs=tuple(int(v) for v in a.procs.split(",")),
                            epochs=a.epochs, hidden=a.hidden, predict=True, workdir=work / "scaling")
        result = run_scaling(cfg, log=lambda s: print(s, flush=True))
        if a.save is not None:
            a.save.write_text(json.dumps(result))
        print("\n" + format_rows(result) + "\n", flush=True)
    if a.no_extrapolate:
        return 0
    c, m = result["config"], result["machine"]
    cut_nodes = parse_count(a.cut_nodes) if a.cut_nodes else int(c["num_nodes"])
    cuts = measure_cuts(a.cut_graphs.split(","), a.cut_methods.split(","), cut_nodes,
                        float(c["num_edges"]) / float(c["num_nodes"]), a.machines, work)
    target = parse_count(a.target_nodes)
    rows = extrapolate(result, cuts, target_nodes=target, machines=a.machines, cores=a.cores)
    unit_ns = 1e9 * m["serial_step_s"] / m["work_units"]
    print(f"\n{a.machines} machines x {a.cores} cores, one rank each; {target:,} nodes, "
          f"{target * float(c['num_edges']) / float(c['num_nodes']):,.0f} edges; {c['model']} {c['layers']} layers, "
          f"{c['in_dim']} features, hidden {c['hidden']}; serial work {unit_ns:.1f} ns per (edge + node), thread "
          f"efficiency {m['thread_efficiency']:.2f}, {m['row_floats']:.0f} floats per halo row and "
          f"{m['exchanges']} exchanges per step (measured on {os.cpu_count()} cores here); halo and balance of "
          f"{cut_nodes:,}-node graphs\n")
    print_table(rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
