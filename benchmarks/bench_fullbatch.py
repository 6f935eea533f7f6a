"""Full-batch training step: Trellis vs PyG, side by side in the same run (each in its own process).

    python -m benchmarks.bench_fullbatch [--sizes 100k,1m] [--models gcn,gat] [--repeat 5] [--device cuda]

GCN: 2 layers, hidden 256. GAT: 2 layers, 4 heads x 64. 128 input features, generated planted-partition
graphs. PyG's GCN runs at its fastest configuration here (a CSR ``adj_t`` with ``cached=True``); PyG's GAT
uses ``edge_index`` (it has no CSR path without torch-sparse). Reported: median step time (forward,
backward, optimizer step), peak RssAnon of the process (graph and features included, identical data for
both), and the ratios Trellis / PyG. With ``--device cuda`` the step is timed with the device
synchronized and memory is the peak of ``torch.cuda.max_memory_allocated`` (the tensors each system
allocates on the GPU; the CUDA context is the same for both and left out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import PeakMemory, print_table, run_isolated, time_steps

SIZES = {"100k": (100_000, 20), "1m": (1_000_000, 10)}  # nodes, avg degree (2M and 10M edges)
CACHE = Path(tempfile.gettempdir()) / "trellis-bench-graphs"


def graph_store(size: str) -> str:
    from trellis.data.generate import generate_sbm

    nodes, deg = SIZES[size]
    out = CACHE / f"sbm-{size}"
    if not (out / "manifest.json").exists():
        generate_sbm(out, nodes=nodes, avg_degree=deg, features=128, classes=16, seed=0)
    return str(out)


def _child(args: dict) -> dict:
    from trellis.data.store import open_store

    torch.manual_seed(0)
    dev = torch.device(args.get("device", "cpu"))
    store = open_store(args["store"], verify=False)
    x = torch.from_numpy(np.ascontiguousarray(store.x)).to(dev)
    y = torch.from_numpy(np.ascontiguousarray(store.y)).to(dev)
    train = torch.from_numpy(np.ascontiguousarray(store.split("train"))).to(dev)
    c = int(store.num_classes)
    with PeakMemory() as mem:
        if args["system"] == "trellis":
            from trellis.nn import build_model
            from trellis.ops.graph import CSRGraph

            graph = CSRGraph.from_store(store).to(dev)
            if args["model"] == "gcn":
                model = build_model("gcn", 128, c, hidden=256, layers=2, dropout=0.5)
            else:
                model = build_model("gat", 128, c, hidden=64, heads=4, layers=2, dropout=0.5)

            def forward() -> torch.Tensor:
                return model(graph, x)
        else:
            from torch_geometric.nn import GATConv, GCNConv
            from torch_geometric.utils import to_torch_csr_tensor

            indptr = torch.from_numpy(np.asarray(store.indptr))
            src = torch.from_numpy(np.asarray(store.indices))
            dst = torch.repeat_interleave(torch.arange(store.num_nodes), indptr[1:] - indptr[:-1])
            edge_index = torch.stack([src, dst]).to(dev)
            if args["model"] == "gcn":
                adj_t = to_torch_csr_tensor(torch.stack([dst, src]), size=(store.num_nodes, store.num_nodes)).to(dev)
                convs = torch.nn.ModuleList([GCNConv(128, 256, cached=True), GCNConv(256, c, cached=True)])
                graph_arg = adj_t
                act = torch.relu
            else:
                convs = torch.nn.ModuleList([GATConv(128, 64, heads=4, dropout=0.5),
                                             GATConv(256, c, heads=1, dropout=0.5)])
                graph_arg = edge_index
                act = torch.nn.functional.elu
            model = convs

            def forward() -> torch.Tensor:
                h = torch.nn.functional.dropout(x, 0.5, True)
                h = act(convs[0](h, graph_arg))
                h = torch.nn.functional.dropout(h, 0.5, True)
                return convs[1](h, graph_arg)
        model = model.to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model.train()

        def step() -> None:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(forward()[train], y[train])
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = time_steps(step, warmup=2, repeat=args["repeat"])
    if dev.type == "cuda":
        return {"step_s": t, "peak_anon_mb": torch.cuda.max_memory_allocated(dev) / 2**20, "hwm_mb": 0.0}
    return {"step_s": t, "peak_anon_mb": mem.peak_anon_mb, "hwm_mb": PeakMemory.hwm_mb()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--sizes", default="100k,1m")
    p.add_argument("--models", default="gcn,gat")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then CUDA allocations)")
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return
    rows = []
    for size in a.sizes.split(","):
        store = graph_store(size)
        for model in a.models.split(","):
            res = {s: run_isolated("benchmarks.bench_fullbatch",
                                   {"system": s, "model": model, "store": store, "repeat": a.repeat,
                                    "device": a.device})
                   for s in ("trellis", "pyg")}
            row = {"graph": size, "model": model, "device": a.device}
            for s, r in res.items():
                row[f"{s}_step_s"] = r.get("step_s", r.get("error", "?"))
                row[f"{s}_peak_anon_mb"] = r.get("peak_anon_mb", "")
            if all("step_s" in r for r in res.values()):
                row["time_ratio"] = res["trellis"]["step_s"] / res["pyg"]["step_s"]
                row["mem_ratio"] = res["trellis"]["peak_anon_mb"] / res["pyg"]["peak_anon_mb"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows, ["graph", "model", "device", "trellis_step_s", "pyg_step_s", "time_ratio", "trellis_peak_anon_mb",
                       "pyg_peak_anon_mb", "mem_ratio"])


if __name__ == "__main__":
    main()
