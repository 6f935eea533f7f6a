"""Exact full-neighbourhood inference on a large graph: Trellis vs PyG's whole-graph forward, side by side.

    python -m benchmarks.bench_inference [--store PATH | --nodes 1m] [--models sage,gcn] [--hidden 256]
                                         [--repeat 3] [--data-dir DIR]

What every mini-batch, cluster and buffer run does after each epoch: the model's outputs for every node over
full neighbourhoods (:func:`trellis.loader.inference.layerwise_inference`). Three ways, each in its own
process, with the same weights:

* **trellis**: the default since 2026-11-26, a layer whose input is in memory runs once over the whole graph
  (the SpMM engine, no per-edge tensors);
* **trellis chunked**: the same function with ``whole_layers=False``, the layer-wise chunks every layer took
  before (each chunk samples its rows' full in-neighbourhoods and gathers their input rows);
* **trellis mapped**: the features as ``--strategy mini`` holds them, a memory map read row by row
  (:class:`~trellis.loader.features.ArrayRows`): the first layer stays in chunks, the others run whole;
* **pyg**: PyG's own ``SAGEConv`` / ``GCNConv`` stack on the whole graph with a ``torch.sparse_csr_tensor``
  ``adj_t`` (``torch_geometric.utils.spmm``; the graph's transposed adjacency, as PyG's docs give it). PyG's
  layer-wise ``NeighborLoader`` inference needs ``pyg-lib`` or ``torch-sparse``, which have no wheel for
  torch 2.13 here (see ``bench_minibatch``).

Reported: the median wall time of ``--repeat`` inferences after a warm-up, the process's peak ``RssAnon``
sampled from outside (the features and the graph included), and the largest difference of each output from
Trellis's (a check that the three compute the same thing).

The store is an SBM graph (average degree 10, 128 features, 10 classes) generated once under ``--data-dir``,
or ``--store``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_outofcore import StoreSpec, child_env, failure, parse_count, run_watched, store_for
from benchmarks.common import print_table

SYSTEMS = ("trellis", "trellis chunked", "trellis mapped", "pyg")


def _child(args: dict) -> None:
    import numpy as np
    import torch

    from trellis.data.store import GraphStore
    from trellis.loader.features import ArrayRows
    from trellis.loader.inference import layerwise_inference
    from trellis.nn.models import build_model

    torch.set_num_threads(args["threads"])
    s = GraphStore(args["store"])
    system = args["system"]
    # the mapped variant reads rows from the store's memory map and never holds the features whole
    x = None if system == "trellis mapped" else torch.from_numpy(np.array(s.x, dtype=np.float32))
    indptr = np.array(s.indptr, dtype=np.int64)
    indices = np.array(s.indices, dtype=np.int64)
    torch.manual_seed(0)
    model = build_model(args["model"], s.num_features, s.num_classes, hidden=args["hidden"]).eval()
    if system == "pyg":
        run = _pyg(model, args["model"], indptr, indices, x)
    else:
        whole = system != "trellis chunked"
        src = ArrayRows(s.x) if system == "trellis mapped" else x

        def run() -> torch.Tensor:
            return layerwise_inference(model, indptr, indices, src, whole_layers=whole)
    out = run()  # warm-up: numba compiles, PyG builds its caches
    times = []
    for _ in range(args["repeat"]):
        t = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t)
    np.save(args["out"], out.numpy())
    print(json.dumps({"time_s": statistics.median(times)}))


def _pyg(model, name: str, indptr, indices, x):
    """PyG's conv stack with ``model``'s weights, on the whole graph as a sparse CSR ``adj_t``."""
    import torch
    from torch_geometric.nn import GCNConv, SAGEConv

    n = indptr.shape[0] - 1
    adj_t = torch.sparse_csr_tensor(torch.from_numpy(indptr), torch.from_numpy(indices),
                                    torch.ones(indices.shape[0]), size=(n, n))
    convs = []
    for c in model.convs:
        if name == "sage":
            p = SAGEConv(c.in_dim, c.out_dim, aggr="mean")
            p.lin_l.load_state_dict(c.lin_l.state_dict())
            p.lin_r.load_state_dict(c.lin_r.state_dict())
        else:
            p = GCNConv(c.in_dim, c.out_dim)
            p.lin.weight.data.copy_(c.lin.weight.data)
            p.bias.data.copy_(c.bias.data)
        convs.append(p.eval())

    @torch.no_grad()
    def run() -> torch.Tensor:
        h = x
        for i, conv in enumerate(convs):
            h = conv(h, adj_t)
            if i < len(convs) - 1:
                h = h.relu()
        return h
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--store", help="a store to read (default: a generated SBM graph of --nodes)")
    ap.add_argument("--nodes", default="1m")
    ap.add_argument("--models", default="sage,gcn")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "trellis-bench-ooc"))
    args = ap.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    import numpy as np

    if args.store:
        store = Path(args.store)
    else:
        data_dir = Path(args.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        store, _ = store_for(data_dir, StoreSpec(parse_count(args.nodes), 10.0, 128))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            ours = None
            for system in args.systems.split(","):
                out = Path(tmp) / f"{model}-{system.replace(' ', '_')}.npy"
                child = {"store": str(store), "model": model, "hidden": args.hidden, "repeat": args.repeat,
                         "threads": args.threads, "system": system, "out": str(out)}
                w = run_watched([sys.executable, "-m", "benchmarks.bench_inference", "--child", json.dumps(child)],
                                env=child_env())
                if w.rc != 0:
                    rows.append({"model": model, "system": system, "time s": failure(w)})
                    continue
                res = json.loads(w.stdout.strip().splitlines()[-1])
                y = np.load(out)
                if ours is None:
                    ours = (res["time_s"], y)
                rows.append({"model": model, "system": system, "time s": res["time_s"],
                             "vs trellis": res["time_s"] / ours[0],
                             "peak RssAnon MiB": w.peak_anon / 2**20,
                             "max |Δout| vs trellis": f"{float(np.abs(y - ours[1]).max()):.1e}"})
                print(f"  {model} / {system}: {res['time_s']:.2f} s", flush=True)
    print(f"\nstore {store}; hidden {args.hidden}; 2 layers; median of {args.repeat}; {args.threads} threads\n")
    print_table(rows, ["model", "system", "time s", "vs trellis", "peak RssAnon MiB", "max |Δout| vs trellis"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
