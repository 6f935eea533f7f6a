"""Mini-batch GraphSAGE: batch preparation and epoch time, Trellis vs PyG, side by side in one run.

    python -m benchmarks.bench_minibatch [--graphs 100k,1m,computers] [--batches 40] [--epochs 2]

Setup (issue #4): GraphSAGE (mean), 2 layers, hidden 256, fanouts [15, 10], batch 1024, Adam lr 0.01.
Graphs: generated planted-partition graphs with 100k nodes / 2M edges and 1M nodes / 10M edges (128
features, 16 classes), and Amazon Computers (767 features, imported from ../shared/data). Every figure
runs in its own process (peak memory stays separate), one after another.

What is compared -- stated exactly, since PyG's sampler does not run here:

* **Trellis**: ``trellis.loader`` (numba sampler, nested blocks with reverse CSRs, feature gather into
  reused buffers) -- with 1 and with 2 numba threads -- and, for the epoch, ``--strategy mini``'s own
  training step (:class:`trellis.train.strategies.batch.MiniBatch`, prefetching one batch ahead).
* **PyG**: ``torch_geometric.loader.NeighborLoader`` needs ``pyg-lib`` or ``torch-sparse``; neither has a
  wheel for torch 2.13 and we do not build torch-sparse here. The benchmark first tries PyG's own
  loader; when it raises (it does here), it runs :class:`PygRefNeighborLoader`, a pure-PyTorch
  reimplementation of the algorithm of pyg-lib's ``neighbor_sample`` (CSC input, directed, uniform
  without replacement, each hop samples only the nodes first reached at the previous hop, global-to-local
  map, one COO ``edge_index`` for all hops) followed by NeighborLoader's ``filter_data`` (``x[node]``,
  ``y[seed]``). The model is PyG's own ``SAGEConv`` stack on that ``edge_index`` (every layer over all
  sampled nodes, as in PyG's examples). Being vectorized torch rather than C++, the reimplementation is
  slower than pyg-lib would be; NOTES.md records PyG's real loader (torch-sparse built from source) at
  7.5 batches/s and DGL at 43 batches/s on the 100k graph on this machine -- quote those beside ours.

Columns: ``prep b/s`` = batches/s of sampling + feature gather (what a trainer receives; sampling-only in
``sample b/s``), ``edges/s`` = sampled edges per second with gather, ``epoch s`` = one epoch of
training (sampling, gather, forward, backward, step) over the training split (Amazon Computers: over all
nodes, since its split has only 200 training nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import PeakMemory, print_table, run_isolated

SIZES = {"100k": (100_000, 20), "1m": (1_000_000, 10)}  # nodes, avg degree (2M and 10M edges)
CACHE = Path(tempfile.gettempdir()) / "trellis-bench-graphs"
COMPUTERS = Path(__file__).resolve().parents[2] / "shared" / "data" / "amazon-computers"
FANOUTS = [15, 10]
BATCH = 1024
HIDDEN = 256


def graph_store(name: str) -> str:
    """Generate or import the store once (cached under the temp dir, shared with the other benchmarks)."""
    if name == "computers":
        out = CACHE / "amazon-computers"
        if not (out / "manifest.json").exists():
            from trellis.data.importers import import_graph

            import_graph(COMPUTERS, out, progress=False)
        return str(out)
    from trellis.data.generate import generate_sbm

    nodes, deg = SIZES[name]
    out = CACHE / f"sbm-{name}"
    if not (out / "manifest.json").exists():
        generate_sbm(out, nodes=nodes, avg_degree=deg, features=128, classes=16, seed=0, progress=False)
    return str(out)


def targets(store, name: str, purpose: str) -> np.ndarray:
    """Throughput: every node (batches/s needs many batches); epoch: the training split (all on computers)."""
    if purpose == "throughput" or name == "computers":
        return np.arange(store.num_nodes, dtype=np.int64)
    return np.asarray(store.split("train"), dtype=np.int64)


# ---- PyG reference --------------------------------------------------------------------------------------
class PygRefNeighborLoader:
    """Pure-PyTorch reimplementation of PyG's ``NeighborLoader`` with pyg-lib's CPU ``neighbor_sample``.

    Algorithm (pyg-lib ``neighbor_sample``, ``replace=False``, ``directed=True``, ``disjoint=False``): the
    seeds get local ids ``0..B-1``; at hop ``h`` every node first reached at hop ``h-1`` draws
    ``min(k_h, deg)`` distinct in-neighbours uniformly; unseen ones get the next local ids; the sampled
    edges (``row`` = neighbour, ``col`` = the node it was sampled for) of all hops form one COO
    ``edge_index``. Then ``filter_data`` gathers ``x[node]`` and the seeds' labels. Uniform sampling without
    replacement is vectorized as "random key per candidate edge, keep the ``k`` smallest per node".
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, x: torch.Tensor, y: torch.Tensor,
                 input_nodes: np.ndarray, num_neighbors: list[int], batch_size: int, seed: int = 0) -> None:
        self.rowptr = torch.from_numpy(np.asarray(indptr, dtype=np.int64))
        self.col = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        self.x, self.y = x, y
        self.input_nodes = torch.from_numpy(np.asarray(input_nodes, dtype=np.int64))
        self.num_neighbors = num_neighbors
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.gather = True
        self.assoc = torch.full((self.rowptr.numel() - 1,), -1, dtype=torch.int64)

    def __len__(self) -> int:
        return -(-self.input_nodes.numel() // self.batch_size)

    def __iter__(self):
        perm = self.input_nodes[torch.randperm(self.input_nodes.numel(), generator=self.gen)]
        for i in range(len(self)):
            yield self.sample(perm[i * self.batch_size:(i + 1) * self.batch_size], self.gather)

    def sample(self, seeds: torch.Tensor, gather: bool = True) -> dict:
        assoc, rowptr, col = self.assoc, self.rowptr, self.col
        n = seeds.numel()
        assoc[seeds] = torch.arange(n)
        nodes = [seeds]
        rows, cols = [], []
        frontier, frontier_local = seeds, torch.arange(n)
        for k in self.num_neighbors:
            start = rowptr[frontier]
            deg = rowptr[frontier + 1] - start
            total = int(deg.sum())
            seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg)
            first = torch.repeat_interleave(torch.cumsum(deg, 0) - deg, deg)
            offs = torch.arange(total) - first
            pos = torch.repeat_interleave(start, deg) + offs
            if k >= 0:
                key = seg.to(torch.float64) + torch.rand(total, generator=self.gen, dtype=torch.float64)
                order = torch.argsort(key)
                keep = offs < k  # rank within the node's (randomly ordered) candidates
                pos, seg = pos[order][keep], seg[order][keep]
            nbr = col[pos]
            loc = assoc[nbr]
            new = torch.unique(nbr[loc < 0])
            assoc[new] = torch.arange(n, n + new.numel())
            rows.append(assoc[nbr])
            cols.append(frontier_local[seg])
            nodes.append(new)
            frontier, frontier_local = new, torch.arange(n, n + new.numel())
            n += new.numel()
        node = torch.cat(nodes)
        assoc[node] = -1
        out = {"edge_index": torch.stack([torch.cat(rows), torch.cat(cols)]), "node": node, "batch_size": seeds.numel()}
        if gather:
            out["x"] = self.x.index_select(0, node)
            out["y"] = self.y.index_select(0, seeds)
        return out


def pyg_loader(store, ids: np.ndarray, x: torch.Tensor, y: torch.Tensor, seed: int = 0):
    """PyG's own NeighborLoader if it runs here, else the reference; returns ``(iterable, description)``."""
    try:
        from torch_geometric.data import Data
        from torch_geometric.loader import NeighborLoader

        indptr = torch.from_numpy(np.asarray(store.indptr))
        src = torch.from_numpy(np.asarray(store.indices))
        dst = torch.repeat_interleave(torch.arange(store.num_nodes), indptr[1:] - indptr[:-1])
        data = Data(x=x, y=y, edge_index=torch.stack([src, dst]), num_nodes=store.num_nodes)
        ld = NeighborLoader(data, num_neighbors=FANOUTS, batch_size=BATCH, input_nodes=torch.from_numpy(ids),
                            shuffle=True)
        next(iter(ld))
        return ld, "torch_geometric.loader.NeighborLoader"
    except Exception as exc:  # noqa: BLE001 - ImportError here: no pyg-lib / torch-sparse
        ref = PygRefNeighborLoader(store.indptr, store.indices, x, y, ids, FANOUTS, BATCH, seed)
        return ref, f"PygRefNeighborLoader (PyG's loader failed: {type(exc).__name__}: {str(exc)[:80]})"


# ---- children -------------------------------------------------------------------------------------------
def _child(args: dict) -> dict:
    from trellis.data.store import open_store

    torch.set_num_threads(args.get("threads", 2))
    store = open_store(args["store"], verify=False)
    name = args["graph"]
    if args["what"] == "trellis_prep":
        import numba

        from trellis.loader.throughput import sampler_throughput

        numba.set_num_threads(args["threads"])
        x = np.array(store.x)
        r = sampler_throughput(store.indptr, store.indices, targets(store, name, "throughput"), FANOUTS, BATCH,
                               x=x, batches=args["batches"], workers=1, prefetch=0, threads=args["threads"])
        return {"prep_bps": r["sampling_gather"]["batches_per_s"], "sample_bps": r["sampling"]["batches_per_s"],
                "edges_per_s": r["sampling_gather"]["edges_per_s"], "inputs": r["inputs_per_batch"],
                "edges": r["edges_per_batch"]}
    if args["what"] == "pyg_prep":
        x = torch.from_numpy(np.array(store.x))
        y = torch.from_numpy(np.array(store.y))
        ids = targets(store, name, "throughput")
        ld, desc = pyg_loader(store, ids, x, y)
        res = {"impl": desc}
        def cycle():
            while True:
                yield from ld

        for label, gather in (("sample_bps", False), ("prep_bps", True)):
            if isinstance(ld, PygRefNeighborLoader):
                ld.gather = gather
            elif not gather:
                continue  # PyG's own loader always gathers
            it = cycle()
            for _ in range(3):
                next(it)
            n = edges = inputs = 0
            t0 = time.perf_counter()
            for _ in range(args["batches"]):
                b = next(it)
                if isinstance(b, dict):
                    edges += b["edge_index"].shape[1]
                    inputs += b["node"].numel()
                else:
                    edges += b.edge_index.shape[1]
                    inputs += b.num_nodes
                n += 1
            dt = time.perf_counter() - t0
            res[label] = n / dt
            if gather:
                res["edges_per_s"] = edges / dt
                res["inputs"] = inputs / n
                res["edges"] = edges / n
        return res
    # epoch time
    with PeakMemory() as mem:
        if args["what"] == "trellis_epoch":
            import numba

            numba.set_num_threads(args["threads"])
            from trellis.train.build import default_model_factory, make_model
            from trellis.train.config import TrainConfig
            from trellis.train.strategies.batch import MiniBatch

            cfg = TrainConfig(store=args["store"], model="sage", strategy="mini", fanouts="15,10", batch_size=BATCH,
                              hidden=HIDDEN, layers=2, dropout=0.5, lr=0.01, prefetch=args.get("prefetch", 2),
                              feature_norm="none", device="cpu")
            strat = MiniBatch(cfg, torch.device("cpu"))
            strat.load()
            data = strat.data
            if name == "computers":  # train over every node: rebuild the loader over them
                data.splits["train"] = torch.arange(store.num_nodes)
                strat.loader = strat.make_loader()
            torch.manual_seed(0)
            model = make_model(default_model_factory, "sage", data.in_dim, data.task.num_outputs, hidden=HIDDEN,
                               layers=2, dropout=0.5)
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            times = []
            for epoch in range(args["epochs"] + 1):
                t0 = time.perf_counter()
                float(strat.train_step(model, opt, data.task, epoch))
                times.append(time.perf_counter() - t0)
            res = {"epoch_s": float(np.median(times[1:])), "batches": len(strat.loader)}
        else:
            import torch.nn.functional as F
            from torch_geometric.nn import SAGEConv

            x = torch.from_numpy(np.array(store.x))
            y = torch.from_numpy(np.array(store.y))
            ids = targets(store, name, "epoch")
            ld, desc = pyg_loader(store, ids, x, y)
            torch.manual_seed(0)
            convs = torch.nn.ModuleList([SAGEConv(x.shape[1], HIDDEN), SAGEConv(HIDDEN, int(store.num_classes))])
            opt = torch.optim.Adam(convs.parameters(), lr=0.01)

            def epoch() -> None:
                convs.train()
                for b in ld:
                    if isinstance(b, dict):
                        h, ei, bs, yb = b["x"], b["edge_index"], b["batch_size"], b["y"]
                    else:
                        h, ei, bs, yb = b.x, b.edge_index, b.batch_size, b.y[: b.batch_size]
                    opt.zero_grad()
                    for i, conv in enumerate(convs):
                        h = F.dropout(h, 0.5, True)
                        h = conv(h, ei)
                        if i == 0:
                            h = F.relu(h)
                    loss = F.cross_entropy(h[:bs], yb)
                    loss.backward()
                    opt.step()

            times = []
            for _ in range(args["epochs"] + 1):
                t0 = time.perf_counter()
                epoch()
                times.append(time.perf_counter() - t0)
            res = {"epoch_s": float(np.median(times[1:])), "batches": len(ld), "impl": desc}
    res["peak_anon_mb"] = mem.peak_anon_mb
    return res


def run_dgl(python: str, args: dict) -> dict:
    """Run ``benchmarks/dgl_minibatch.py`` in the DGL environment; ``{"error": ...}`` when it fails."""
    import subprocess

    script = Path(__file__).with_name("dgl_minibatch.py")
    proc = subprocess.run([python, str(script), json.dumps(args)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(results: list[dict], key: str, fn=max):
    vals = [r[key] for r in results if isinstance(r.get(key), float)]
    return fn(vals) if vals else (results[0].get("error") if results else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", default="100k,1m,computers")
    ap.add_argument("--batches", type=int, default=40, help="batches timed for batches/s")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="rounds; systems alternate within a round and the best round counts (default: 2)")
    ap.add_argument("--skip-epoch", action="store_true", help="only batch preparation")
    ap.add_argument("--epoch-systems", default="trellis,dgl,pyg",
                    help="systems whose epoch is timed (PyG's style is slow on large graphs) (default: all)")
    ap.add_argument("--dgl-python", default=os.environ.get("TRELLIS_DGL_PYTHON", "/tmp/dglenv/bin/python"),
                    help="Python of the DGL environment (benchmarks/make_dgl_env.sh); skipped if absent")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    mod = "benchmarks.bench_minibatch"
    dgl_ok = Path(a.dgl_python).exists()
    rows = []
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at start; torch {torch.__version__}; DGL: "
          f"{a.dgl_python if dgl_ok else 'not available'}", flush=True)
    for g in a.graphs.split(","):
        store = graph_store(g)
        common = {"store": store, "graph": g, "batches": a.batches, "epochs": a.epochs}
        res: dict[str, list[dict]] = {k: [] for k in ("t1", "t2", "pyg", "dgl", "te", "pe", "de")}
        systems = set(a.epoch_systems.split(","))

        def record(key: str, value: dict, res: dict = res, g: str = g) -> None:
            res[key].append(value)
            print(f"# {g} {key}: {json.dumps(value)}", flush=True)  # partial results survive an abort

        for _ in range(a.repeat):
            record("t1", run_isolated(mod, {**common, "what": "trellis_prep", "threads": 1}))
            record("t2", run_isolated(mod, {**common, "what": "trellis_prep", "threads": 2}))
            record("pyg", run_isolated(mod, {**common, "what": "pyg_prep", "threads": 2}))
            if dgl_ok:
                record("dgl", run_dgl(a.dgl_python, {"store": store, "what": "prep", "batches": a.batches,
                                                     "ids": "all", "threads": 2}))
            if not a.skip_epoch:
                if "trellis" in systems:
                    record("te", run_isolated(mod, {**common, "what": "trellis_epoch", "threads": 2}))
                if "pyg" in systems:
                    record("pe", run_isolated(mod, {**common, "what": "pyg_epoch", "threads": 2}))
                if dgl_ok and "dgl" in systems:
                    record("de", run_dgl(a.dgl_python, {"store": store, "what": "epoch", "epochs": a.epochs,
                                                        "ids": "all" if g == "computers" else "train",
                                                        "threads": 2}))
        t2 = res["t2"][0]
        row = {"graph": g,
               "trellis prep b/s 1thr": _best(res["t1"], "prep_bps"),
               "trellis prep b/s 2thr": _best(res["t2"], "prep_bps"),
               "trellis sample b/s 2thr": _best(res["t2"], "sample_bps"),
               "trellis M edges/s": (_best(res["t2"], "edges_per_s") or 0) / 1e6,
               "dgl prep b/s": _best(res["dgl"], "prep_bps"), "dgl sample b/s": _best(res["dgl"], "sample_bps"),
               "pyg-ref prep b/s": _best(res["pyg"], "prep_bps"), "pyg-ref sample b/s": _best(res["pyg"], "sample_bps"),
               "inputs/batch trellis,dgl,pyg": f"{t2.get('inputs', 0):.0f},"
                                              f"{(res['dgl'] or [{}])[0].get('inputs', 0):.0f},"
                                              f"{res['pyg'][0].get('inputs', 0):.0f}"}
        for other in ("dgl", "pyg-ref"):
            mine, theirs = row["trellis prep b/s 2thr"], row[f"{other} prep b/s"]
            if isinstance(mine, float) and isinstance(theirs, float):
                row[f"prep x {other}"] = mine / theirs
        if not a.skip_epoch:
            row.update({"trellis epoch s": _best(res["te"], "epoch_s", min),
                        "dgl epoch s": _best(res["de"], "epoch_s", min),
                        "pyg-ref epoch s": _best(res["pe"], "epoch_s", min),
                        "batches/epoch": (res["te"] or [{}])[0].get("batches"),
                        "trellis peak anon MB": (res["te"] or [{}])[0].get("peak_anon_mb")})
            for other in ("dgl", "pyg-ref"):
                mine, theirs = row["trellis epoch s"], row[f"{other} epoch s"]
                if isinstance(mine, float) and isinstance(theirs, float):
                    row[f"epoch x {other}"] = theirs / mine
        row["pyg impl"] = res["pyg"][0].get("impl", res["pyg"][0].get("error", ""))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at end")
    cols = [c for c in rows[0] if c != "pyg impl"]
    print_table(rows, cols)
    print("PyG side:", rows[0].get("pyg impl"))


if __name__ == "__main__":
    main()
