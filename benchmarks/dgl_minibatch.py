"""DGL's side of ``benchmarks.bench_minibatch``: run with the DGL environment's Python, not Trellis's.

    DGL_PYTHON benchmarks/dgl_minibatch.py '{"store": DIR, "what": "prep"|"epoch", ...}'

DGL does not import with torch 2.13 (NOTES.md), so it runs in a separate virtual environment
(``torch==2.2.1``, ``dgl==2.1.0``, ``numpy<2``, ``pandas<2.3``, ``torchdata==0.7.1``). This script imports
nothing from Trellis: it reads the store's ``.npy`` arrays directly, builds ``dgl.graph(('csc', ...))``
from the same in-edge CSR (column = destination, so DGL samples the same in-neighbours), and uses DGL's
``NeighborSampler`` with ``prefetch_node_feats`` and its ``DataLoader`` (``num_workers=0``) -- DGL's
standard CPU path. DGL's fanouts are listed input layer first, so Trellis's ``15,10`` (15 in-neighbours of
each target) is DGL's ``[10, 15]``. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def main() -> None:
    args = json.loads(sys.argv[1])
    import dgl
    import dgl.nn as dglnn
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(int(args.get("threads", 2)))
    d = Path(args["store"])
    indptr = torch.from_numpy(np.load(d / "indptr.npy"))
    indices = torch.from_numpy(np.load(d / "indices.npy"))
    n = indptr.numel() - 1
    g = dgl.graph(("csc", (indptr, indices, torch.tensor([], dtype=torch.int64))), num_nodes=n)
    x = torch.from_numpy(np.load(d / "x.npy"))
    y = torch.from_numpy(np.load(d / "y.npy"))
    g.ndata["feat"] = x
    g.ndata["label"] = y
    g.create_formats_()
    fanouts = list(reversed(args.get("fanouts", [15, 10])))  # DGL lists the input layer first
    batch = int(args.get("batch_size", 1024))
    if args["ids"] == "all":
        ids = torch.arange(n)
    else:
        ids = torch.from_numpy(np.load(d / "train_idx.npy"))
    out: dict = {"dgl": dgl.__version__, "torch": torch.__version__, "fanouts_dgl_order": fanouts}
    if args["what"] == "prep":
        for label, feats in (("sample_bps", []), ("prep_bps", ["feat"])):
            sampler = dgl.dataloading.NeighborSampler(fanouts, prefetch_node_feats=feats)
            loader = dgl.dataloading.DataLoader(g, ids, sampler, batch_size=batch, shuffle=True, drop_last=False,
                                                num_workers=0)

            def cycle(ld=loader):
                while True:
                    yield from ld

            it = cycle()
            for _ in range(3):
                next(it)
            edges = inputs = 0
            t0 = time.perf_counter()
            for _ in range(int(args["batches"])):
                _, _, blocks = next(it)
                if feats:
                    _ = blocks[0].srcdata["feat"]
                edges += sum(b.num_edges() for b in blocks)
                inputs += blocks[0].num_src_nodes()
            dt = time.perf_counter() - t0
            out[label] = args["batches"] / dt
            if feats:
                out["edges_per_s"] = edges / dt
                out["inputs"] = inputs / args["batches"]
                out["edges"] = edges / args["batches"]
    else:
        hidden = int(args.get("hidden", 256))
        classes = int(y.max()) + 1
        torch.manual_seed(0)
        convs = torch.nn.ModuleList([dglnn.SAGEConv(x.shape[1], hidden, "mean"),
                                     dglnn.SAGEConv(hidden, classes, "mean")])
        opt = torch.optim.Adam(convs.parameters(), lr=0.01)
        sampler = dgl.dataloading.NeighborSampler(fanouts, prefetch_node_feats=["feat"], prefetch_labels=["label"])
        loader = dgl.dataloading.DataLoader(g, ids, sampler, batch_size=batch, shuffle=True, drop_last=False,
                                            num_workers=0)

        def epoch() -> None:
            convs.train()
            for _, _, blocks in loader:
                h = blocks[0].srcdata["feat"]
                yb = blocks[-1].dstdata["label"]
                opt.zero_grad()
                for i, (conv, blk) in enumerate(zip(convs, blocks)):
                    h = F.dropout(h, 0.5, True)
                    h = conv(blk, h)
                    if i == 0:
                        h = F.relu(h)
                loss = F.cross_entropy(h, yb)
                loss.backward()
                opt.step()

        times = []
        for _ in range(int(args.get("epochs", 2)) + 1):
            t0 = time.perf_counter()
            epoch()
            times.append(time.perf_counter() - t0)
        out["epoch_s"] = float(np.median(times[1:]))
        out["batches"] = len(loader)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["peak_rss_mb"] = int(line.split()[1]) / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
