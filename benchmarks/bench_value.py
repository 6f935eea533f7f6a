"""What a run costs: Dorylus's value, 1 / (time x cost), measured at P = 1, 2, 4 and predicted for cloud machines.

    python -m benchmarks.bench_value [--nodes 200k] [--epochs 6] [--workdir DIR]

1. **Measured here.** On a generated SBM graph (GREM layouts), ``trellis train`` one process and ``--parts-dir``
   at P = 2 and 4, every run priced with ``--price-per-hour core=C,gib=G`` (``--core-price``, ``--gib-price``:
   each rank is priced by its threads and its peak RssAnon; the summary's ``value``). On one 2-core machine
   the ranks share the cores, so this says what P costs when it buys no cores.
2. **Predicted for cloud machines** (:mod:`trellis.plan.rank_cost`, priced by :func:`trellis.plan.rank_cost.priced`):
   one large machine against several small ones with the same cores in total, from the measured P = 1
   step, the P = 4 run's bytes per rank and exchanges, a link of ``--link-gbps``, and stated list prices
   (``--large``/``--small``: name, cores, $/hour). Blocking and ``--staleness 1`` (comm hidden behind compute).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.scaling import _cli, _count, _run
from trellis.plan.price import Price
from trellis.plan.rank_cost import CostInputs, predict, priced


def _train(store: Path, out: Path, price: str, epochs: int, *extra: str) -> dict[str, Any]:
    _run(_cli("train", str(store), "--model", "gcn", "--hidden", "64", "--epochs", str(epochs), "--checkpoint-every",
              "0", "--no-progress", "--out", str(out), "--overwrite", "--price-per-hour", price, *extra), timeout=3600)
    s = json.loads((out / "summary.json").read_text())
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    s["_recs"] = recs
    return s


def _machine(text: str) -> tuple[str, int, float]:
    name, cores, price = text.split(",")
    return name, int(cores), float(price)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=_count, default=200_000, help="(default: 200k)")
    p.add_argument("--features", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--epochs", type=int, default=6, help="(default: %(default)s)")
    p.add_argument("--core-price", type=float, default=0.0425, help="$ per core-hour (default: %(default)s)")
    p.add_argument("--gib-price", type=float, default=0.0057, help="$ per GiB-hour (default: %(default)s)")
    p.add_argument("--large", type=_machine, default=("c7i.4xlarge", 16, 0.714),
                   help="NAME,CORES,$/HOUR of the large machine (default: c7i.4xlarge,16,0.714)")
    p.add_argument("--small", type=_machine, default=("c7i.xlarge", 4, 0.1785),
                   help="NAME,CORES,$/HOUR of a small machine (default: c7i.xlarge,4,0.1785)")
    p.add_argument("--link-gbps", type=float, default=12.5, help="small machines' link (default: %(default)s)")
    p.add_argument("--thread-efficiency", type=float, default=0.5, help="assumed (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="(default: a temporary directory)")
    args = p.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="trellis-value-"))
    root.mkdir(parents=True, exist_ok=True)
    store = root / f"sbm-{args.nodes}"
    if not (store / "manifest.json").exists():
        _run(_cli("data", "generate", "sbm", "--nodes", str(args.nodes), "--features", str(args.features),
                  "--classes", "8", "--out", str(store)), timeout=3600)
    price = f"core={args.core_price},gib={args.gib_price}"
    measured: dict[int, dict[str, Any]] = {}
    for ranks in (1, 2, 4):
        extra: list[str] = []
        if ranks > 1:
            parts = root / f"grem-{ranks}"
            if not (parts / "manifest.json").exists():
                _run(_cli("partition", str(store), "--method", "grem", "--parts", str(ranks), "--out", str(parts)),
                     timeout=3600)
            extra = ["--parts-dir", str(parts)]
        measured[ranks] = _train(store, root / f"run-{ranks}", price, args.epochs, *extra)
    rows = []
    for ranks, s in measured.items():
        rows.append({"P": ranks, "step s": f"{s['epoch_time_s_median']:.3f}", "machines": s["machines"],
                     "$/hour": f"{s['cost_per_hour_usd']:.4f}", "$/epoch": f"{s['cost_per_epoch_usd']:.3g}",
                     "value": f"{s['value']:.4g}", "value vs P=1": f"{s['value'] / measured[1]['value']:.2f}x"})
    print(f"measured on this machine (2 cores), SBM {args.nodes:,} nodes, GCN hidden 64, priced {price} "
          "(each rank: its threads and peak RssAnon)")
    print_table(rows, list(rows[0]))
    # predictions for cloud machines
    w = measured[1]["epoch_time_s_median"]
    threads = int(measured[1].get("threads", 2))
    recs4 = measured[4]["_recs"]
    sent = [statistics.median(r["exchange_bytes_per_rank"][i] for r in recs4) for i in range(4)]
    exchanges = len([k for k in recs4[0] if k.startswith("exchange_l") and k.endswith("_bytes")])
    params = int(measured[1].get("num_parameters", 0))
    (ln, lc, lp), (sn, sc, sp) = args.large, args.small
    count = max(1, lc // sc)
    scenarios = [(f"1 x {ln}", CostInputs(ranks=1, compute_s=w, compute_threads=threads,
                                         thread_efficiency=args.thread_efficiency, cores=lc), Price(lp)),
                 (f"{count} x {sn}, blocking", CostInputs(
                     ranks=count, compute_s=w, compute_threads=threads, thread_efficiency=args.thread_efficiency,
                     sent_bytes=[max(sent)] * count, exchanges=exchanges, bandwidth=args.link_gbps * 1.25e8,
                     cores=sc, machines=count, allreduces=2, allreduce_bytes=4.0 * params), Price(sp))]
    scenarios.append((f"{count} x {sn}, --staleness 1", dataclasses.replace(scenarios[1][1], stale=True), Price(sp)))
    pred_rows = []
    base = None
    for name, inp, pr in scenarios:
        b = predict(inp)
        v = priced(b, inp, pr)
        base = base or v["value"]
        pred_rows.append({"configuration": name, "predicted step s": f"{b.total_s:.3f}",
                          "compute + comm": f"{b.compute_s:.3f} + {b.comm_s:.3f}",
                          "$/hour": f"{v['cost_per_hour_usd']:.4f}",
                          "value": f"{v['value']:.4g}", "vs large": f"{v['value'] / base:.2f}x"})
    print(f"\npredicted (cost model) from the measured P = 1 step ({w:.3f} s on {threads} threads, thread efficiency "
          f"{args.thread_efficiency} assumed) and the P = 4 run's bytes per rank; {args.link_gbps} Gb/s links")
    print_table(pred_rows, list(pred_rows[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
