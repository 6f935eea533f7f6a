"""Graph-engine ops: our SpMM / SDDMM / edge softmax vs torch.sparse (and PyG when installed), same run.

    python -m benchmarks.bench_ops [--nodes 100000] [--edges 2000000] [--features 128,256] [--graph uniform]
                                   [--repeat 5] [--no-steps] [--json]

Reports, on one generated graph (uniform random or power-law in-degrees):

* the machine's memory bandwidth (numpy copy of 1 GB, numba triad and read), the ceiling for SpMM;
* SpMM forward (unweighted, and GCN-weighted with the self-loop term) and forward+backward at each feature
  width: ours, ``torch.sparse`` CSR matmul measured in the same run, their ratio, and the bandwidth our
  kernel achieves counting the bytes it must move (gathered source rows + written rows + indices [+ weights]);
* PyG's ``torch_geometric.utils.spmm`` / ``scatter`` if ``torch_geometric`` imports (otherwise says so);
* attention ops at 4 heads x 64 (sddmm, edge softmax, per-head SpMM) against the pure-torch path;
* engine-level training steps: GCN (2 layers, hidden 256, 16 classes) and GAT (4 x 64 then 1 head), built
  directly on the ops (no planner), each in a fresh process reporting its peak RssAnon (graph, features and
  step together, comparable with the DGL/PyG figures in NOTES.md); ``--torch-steps`` adds the pure-torch path.

Times are the minimum and median of ``--repeat`` runs after a warm-up (the warm-up includes numba's JIT or
cache load). The machine may be shared: the load average is printed first; compare ratios within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import PeakMemory, run_isolated
from trellis.ops import WITH_NUMBA, edge_softmax, gcn_norm, sddmm, spmm, use_numba
from trellis.ops.graph import CSRGraph

warnings.filterwarnings("ignore", message=".*Sparse CSR tensor support is in beta.*")
warnings.filterwarnings("ignore", message=".*Sparse invariant checks.*")

# Reference figures from /work/shared/NOTES.md (same machine class, 2 cores, measured by the project lead).
REFERENCE = {"gcn_step": {"DGL": 0.64, "PyG (CSR)": 1.3}, "gat_step": {"DGL": 2.9, "PyG": 6.6}}


#: The clock: wall time by default; ``--cpu-time`` switches to this process's CPU time, which on a shared,
#: loaded machine approximates an idle machine's wall time for single-threaded runs (``--threads 1``).
CLOCK: Callable[[], float] = time.perf_counter


def timeit(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> tuple[float, float]:
    """(min, median) seconds of ``fn`` on :data:`CLOCK` over ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = CLOCK()
        fn()
        ts.append(CLOCK() - t)
    return min(ts), statistics.median(ts)


def make_graph(nodes: int, edges: int, kind: str, seed: int = 0) -> CSRGraph:
    """Random in-edge CSR: uniform endpoints, or power-law in-degrees (Zipf exponent 1) for skew."""
    rng = np.random.default_rng(seed)
    if kind == "powerlaw":
        p = 1.0 / np.arange(1, nodes + 1)
        dst = rng.permutation(nodes)[rng.choice(nodes, edges, p=p / p.sum())]
    else:
        dst = rng.integers(0, nodes, edges)
    src = rng.integers(0, nodes, edges)
    order = np.argsort(dst, kind="stable")
    indptr = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=nodes), out=indptr[1:])
    g = CSRGraph.from_numpy(indptr, src[order], nodes)
    g.reverse()
    return g


def bandwidth(repeat: int) -> dict[str, float]:
    """Memory bandwidth in GB/s: numpy copy (read + write of 1 GB), numba triad (2 reads + 1 write), read."""
    a = np.ones(250_000_000, dtype=np.float32)
    b = np.empty_like(a)
    copy = timeit(lambda: np.copyto(b, a), repeat)[0]
    out = {"numpy_copy": 2 * a.nbytes / copy / 1e9}
    if WITH_NUMBA:
        import numba
        from numba import njit, prange

        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))

        @njit(parallel=True, fastmath=True)
        def triad(x: np.ndarray, y: np.ndarray, z: np.ndarray, s: float) -> None:
            for i in prange(x.shape[0]):
                x[i] = y[i] + s * z[i]

        @njit(parallel=True, fastmath=True)
        def read(x: np.ndarray) -> float:
            s = 0.0
            for i in prange(x.shape[0]):
                s += x[i]
            return s

        c = np.ones_like(a)
        out["numba_triad"] = 3 * a.nbytes / timeit(lambda: triad(b, a, c, np.float32(2.0)), repeat)[0] / 1e9
        out["numba_read"] = a.nbytes / timeit(lambda: read(a), repeat)[0] / 1e9
    return out


def spmm_bytes(g: CSRGraph, f: int, weighted: bool) -> int:
    """Bytes an SpMM must move at least: gathered source rows, written rows, indptr/indices, weights."""
    e, n = g.num_edges, g.num_dst
    return 4 * e * f + 4 * n * f + 8 * e + 8 * (n + 1) + (4 * e if weighted else 0)


def bench_spmm(g: CSRGraph, feats: list[int], repeat: int, peak_bw: float) -> list[dict[str, Any]]:
    rows = []
    ew, sw = gcn_norm(g)
    n = g.num_dst
    a_w = torch.sparse_csr_tensor(g.indptr, g.indices, ew, size=(n, g.num_src))
    a_1 = torch.sparse_csr_tensor(g.indptr, g.indices, torch.ones(g.num_edges), size=(n, g.num_src))
    diag = sw[:, None]
    for f in feats:
        x = torch.randn(g.num_src, f)
        for label, ours, theirs, weighted in (
            ("sum", lambda x=x: spmm(g, x), lambda x=x: a_1 @ x, False),
            ("gcn (w + self)", lambda x=x: spmm(g, x, ew, self_weight=sw), lambda x=x: a_w @ x + diag * x, True),
        ):
            t_ours, m_ours = timeit(ours, repeat)
            t_torch, m_torch = timeit(theirs, repeat)
            bw = spmm_bytes(g, f, weighted) / t_ours / 1e9
            rows.append({"op": f"spmm {label} fwd", "F": f, "ours_s": t_ours, "ours_median_s": m_ours,
                         "torch_sparse_s": t_torch, "torch_median_s": m_torch, "speedup": t_torch / t_ours,
                         "GB/s": bw, "of_peak": bw / peak_bw if peak_bw else float("nan")})
        xg = x.clone().requires_grad_()

        def ours_fb(xg: torch.Tensor = xg) -> None:
            spmm(g, xg, ew, self_weight=sw).sum().backward()

        def torch_fb(xg: torch.Tensor = xg) -> None:
            (torch.sparse.mm(a_w, xg) + diag * xg).sum().backward()

        t_ours, m_ours = timeit(ours_fb, repeat)
        t_torch, m_torch = timeit(torch_fb, repeat)
        rows.append({"op": "spmm gcn fwd+bwd(x)", "F": f, "ours_s": t_ours, "ours_median_s": m_ours,
                     "torch_sparse_s": t_torch, "torch_median_s": m_torch, "speedup": t_torch / t_ours})
    return rows


def bench_pyg(g: CSRGraph, feats: list[int], repeat: int) -> list[dict[str, Any]] | str:
    try:
        import torch_geometric.utils as pyg_utils
    except ImportError:
        return "torch_geometric is not installed in this environment: PyG columns skipped"
    rows = []
    dst, src = g.dst_of_edges(), g.indices
    adj = torch.sparse_csr_tensor(g.indptr, g.indices, torch.ones(g.num_edges), size=(g.num_dst, g.num_src))
    for f in feats:
        x = torch.randn(g.num_src, f)
        t_sc, _ = timeit(lambda x=x: pyg_utils.scatter(x[src], dst, dim=0, dim_size=g.num_dst, reduce="sum"), repeat)
        row = {"op": "pyg scatter(x[src]) sum", "F": f, "pyg_s": t_sc, "ours_s": timeit(lambda x=x: spmm(g, x), 1)[0]}
        try:
            row["pyg_spmm_s"] = timeit(lambda x=x: pyg_utils.spmm(adj, x, reduce="sum"), repeat)[0]
        except Exception as exc:  # noqa: BLE001 - report whatever PyG's version does not support
            row["pyg_spmm_s"] = f"unsupported: {exc}"[:60]
        rows.append(row)
    return rows


def bench_attention(g: CSRGraph, repeat: int, heads: int = 4, dim: int = 64) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(g.num_src, heads, dim, generator=gen)
    el, er = torch.randn(g.num_src, heads, generator=gen), torch.randn(g.num_dst, heads, generator=gen)
    alpha = edge_softmax(g, sddmm(g, el, er))
    grad = torch.randn(g.num_dst, heads, dim, generator=gen)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("sddmm add [E,H]", lambda: sddmm(g, el, er)),
        ("edge_softmax fwd", lambda: edge_softmax(g, alpha)),
        ("spmm per-head fwd", lambda: spmm(g, z, alpha)),
        ("sddmm dot [E,H]", lambda: sddmm(g, z, grad, "dot")),
    ]
    zg, ag = z.clone().requires_grad_(), alpha.clone().requires_grad_()
    cases.append(("spmm per-head fwd+bwd", lambda: spmm(g, zg, ag).backward(grad)))
    rows = []
    for name, fn in cases:
        t_ours, _ = timeit(fn, repeat)
        with use_numba(False):
            t_torch, _ = timeit(fn, max(1, repeat // 2))
        rows.append({"op": name, "H x D": f"{heads}x{dim}", "ours_s": t_ours, "torch_path_s": t_torch,
                     "speedup": t_torch / t_ours})
    return rows


def engine_steps(g: CSRGraph, repeat: int, numba: bool, model: str, classes: int = 16) -> dict[str, Any]:
    """A GCN or GAT training step written directly on the ops (what the layers lower to)."""
    torch.manual_seed(0)
    n = g.num_dst
    x = torch.randn(n, 128)
    y = torch.randint(0, classes, (n,))
    ew, sw = gcn_norm(g)
    l1, l2 = torch.nn.Linear(128, 256), torch.nn.Linear(256, classes)
    opt = torch.optim.Adam([*l1.parameters(), *l2.parameters()])

    def gcn_step() -> None:
        h = F.relu(l1(spmm(g, x, ew, self_weight=sw)))  # aggregate first at 128 < 256
        out = spmm(g, l2(h), ew, self_weight=sw)  # transform first at 16 < 256
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    gl = g.with_self_loops()
    gl.reverse()
    heads, dim = 4, 64
    lin1 = torch.nn.Linear(128, heads * dim, bias=False)
    lin2 = torch.nn.Linear(heads * dim, classes, bias=False)
    att1 = torch.nn.Parameter(torch.randn(2, 1, heads, dim) * 0.1)
    att2 = torch.nn.Parameter(torch.randn(2, 1, 1, classes) * 0.1)
    opt2 = torch.optim.Adam([*lin1.parameters(), *lin2.parameters(), att1, att2])

    def gat(z: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        # Both attention projections as one GEMM with a block-diagonal [2H, H*D] matrix: ~4x cheaper with its
        # backward than (z * att).sum(-1), which materializes [N, H, D] products in both directions.
        n_, h_, d_ = z.shape
        proj = torch.cat([torch.block_diag(*a.unsqueeze(1).unbind(0)) for a in att[:, 0]], 0)
        el, er = (z.reshape(n_, h_ * d_) @ proj.T).split(h_, dim=1)
        logits = sddmm(gl, el, er, "add")
        return spmm(gl, z, edge_softmax(gl, F.leaky_relu(logits, 0.2)))

    def gat_step() -> None:
        h = F.elu(gat(lin1(x).view(n, heads, dim), att1).reshape(n, heads * dim))
        out = gat(lin2(h).view(n, 1, classes), att2).view(n, classes)
        loss = F.cross_entropy(out, y)
        opt2.zero_grad()
        loss.backward()
        opt2.step()

    name, step = (f"{model}_step", gcn_step if model == "gcn" else gat_step)
    with use_numba(numba), PeakMemory() as mem:
        base = mem.peak_anon_mb
        t_min, t_med = timeit(step, repeat, warmup=1)
    return {"op": name, "path": "numba" if numba else "torch", "min_s": t_min, "median_s": t_med,
            "RssAnon_before_MB": base, "RssAnon_peak_MB": mem.peak_anon_mb,
            "reference": ", ".join(f"{k} {v} s" for k, v in REFERENCE[name].items())}


def _child(args: dict[str, Any]) -> dict[str, Any]:
    """One step benchmark in a fresh process, so its peak memory is its own (graph + features + step)."""
    g = make_graph(args["nodes"], args["edges"], args["graph"])
    return engine_steps(g, args["repeat"], args["numba"], args["model"])


def fmt_table(rows: list[dict[str, Any]]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--edges", type=int, default=2_000_000)
    p.add_argument("--features", default="128,256", help="comma-separated feature widths (default: 128,256)")
    p.add_argument("--graph", choices=("uniform", "powerlaw"), default="uniform")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-steps", action="store_true", help="skip the GCN/GAT training steps")
    p.add_argument("--torch-steps", action="store_true", help="also time the steps on the pure-torch path")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--threads", type=int, default=0, help="torch (and engine) threads (default: torch's)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with process CPU time instead of wall time (use with --threads 1 on a busy machine)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child = json.loads(args.child)
        if child.get("cpu_time"):
            CLOCK = time.process_time
        if child.get("threads"):
            torch.set_num_threads(child["threads"])
        print(json.dumps(_child(child)))
        return
    feats = [int(f) for f in args.features.split(",")]

    report: dict[str, Any] = {
        "machine": {"load_avg": os.getloadavg(), "torch_threads": torch.get_num_threads(), "numba": WITH_NUMBA,
                    "clock": "process CPU time" if args.cpu_time else "wall"},
        "graph": {"nodes": args.nodes, "edges": args.edges, "kind": args.graph},
    }
    bw = bandwidth(args.repeat)
    report["bandwidth_GBps"] = bw
    peak = bw.get("numba_triad", bw["numpy_copy"])
    g = make_graph(args.nodes, args.edges, args.graph)
    report["spmm"] = bench_spmm(g, feats, args.repeat, peak)
    report["pyg"] = bench_pyg(g, feats, args.repeat)
    report["attention"] = bench_attention(g, args.repeat)
    if not args.no_steps:
        del g
        report["steps"] = []
        for numba_path in (True, False) if args.torch_steps else (True,):
            for model in ("gcn", "gat"):
                child = {"nodes": args.nodes, "edges": args.edges, "graph": args.graph, "model": model,
                         "numba": numba_path, "repeat": args.repeat if numba_path else max(1, args.repeat // 2),
                         "cpu_time": args.cpu_time, "threads": args.threads}
                report["steps"].append({"op": f"{model}_step", **run_isolated("benchmarks.bench_ops", child)})

    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return
    m = report["machine"]
    print(f"machine: load average {tuple(round(v, 1) for v in m['load_avg'])}, {os.cpu_count()} CPUs, "
          f"torch threads {m['torch_threads']} (the engine's kernels use as many), numba kernels {m['numba']}, "
          f"clock: {m['clock']}")
    print("memory bandwidth GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))
    print(f"graph: {args.graph}, {args.nodes} nodes, {args.edges} edges\n")
    print("SpMM (seconds; speedup = torch.sparse / ours; GB/s = bytes moved / our time)")
    print(fmt_table(report["spmm"]))
    print()
    print(report["pyg"] if isinstance(report["pyg"], str) else fmt_table(report["pyg"]))
    print("\nAttention ops (torch_path = this package's pure-torch path: gathers, materialized messages)")
    print(fmt_table(report["attention"]))
    if "steps" in report:
        print("\nTraining steps on the ops (reference = NOTES.md figures, not measured in this run)")
        print(fmt_table(report["steps"]))


if __name__ == "__main__":
    main()
