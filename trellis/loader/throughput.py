"""Throughput of batch preparation, as ``trellis bench sampler`` and the benchmarks report it.

Two figures, side by side (NOTES #4): *sampling only* (blocks, relabeling, reverse CSRs), and *sampling +
feature gather* -- the batch a trainer actually receives, which is what PyG's ``NeighborLoader`` and DGL's
loader with feature prefetch hand over. Each is measured over the same batches (same seeds), after a
warm-up that compiles the kernels and touches the buffers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from trellis.loader.blocks import Batch
from trellis.loader.prefetch import Prefetcher
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.utils.numba import get_num_threads, set_num_threads


def sampler_throughput(indptr: np.ndarray, indices: np.ndarray, ids: np.ndarray, fanouts: Sequence[int],
                       batch_size: int, *, x: np.ndarray | None = None, labor: bool = False, batches: int = 50,
                       workers: int = 1, prefetch: int | None = None, threads: int | None = None, seed: int = 0,
                       warmup: int = 3) -> dict[str, Any]:
    """Measure batches/s and sampled edges/s, sampling only and sampling + feature gather.

    Args:
        indptr: In-edge CSR row pointers.
        indices: In-edge sources.
        ids: Target ids (e.g. the training split); batches follow one seeded shuffle of them.
        fanouts: Per-layer fanouts, target layer first.
        batch_size: Targets per batch.
        x: ``[N, F]`` features to gather (None: only the sampling figure).
        labor: LABOR sampling (default: False).
        batches: Batches timed per figure, over as many epochs as needed (default: 50).
        workers: Threads preparing batches concurrently (default: 1).
        prefetch: Batches in flight (default: ``2 * workers``).
        threads: numba threads per worker (default: numba's setting, i.e. every core).
        seed: Seed of the shuffle and the samples (default: 0).
        warmup: Untimed batches first (default: 3).

    Returns:
        A JSON-ready dict: per-figure ``batches_per_s``, ``edges_per_s``, ``seconds``, plus the mean sampled
        edges and input nodes per batch and the settings.
    """
    if threads is not None:
        set_num_threads(int(threads))
    sampler = NeighborSampler(indptr, indices, fanouts, labor=labor)
    depth = 2 * workers if prefetch is None else prefetch
    loader = NeighborLoader(sampler, ids, batch_size, x=x, seed=seed, prefetch=depth, workers=workers)
    # (epoch plan, index) of every timed batch: as many epochs as it takes to reach ``batches``
    plans = [loader.plan(e) for e in range(-(-batches // max(1, len(loader))))]
    work = [(p, i) for p in plans for i in range(len(p))][:batches]
    n = len(work)
    for p, i in work[:warmup]:
        loader.get(p, i, gather=x is not None)
    out: dict[str, Any] = {
        "fanouts": list(fanouts), "batch_size": batch_size, "labor": labor, "workers": workers,
        "numba_threads": get_num_threads(), "batches": n, "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    figures = [("sampling", False)] + ([("sampling_gather", True)] if x is not None else [])
    for name, gather in figures:
        edges = inputs = 0
        t0 = time.perf_counter()

        def make(k: int, g: bool = gather) -> Batch:
            return loader.get(*work[k], gather=g)

        with Prefetcher(make, n, depth=depth, workers=workers) as it:
            for b in it:
                edges += b.num_edges
                inputs += b.num_inputs
        dt = time.perf_counter() - t0
        out[name] = {"batches_per_s": n / dt, "edges_per_s": edges / dt, "seconds": dt}
        out["edges_per_batch"] = edges / max(n, 1)
        out["inputs_per_batch"] = inputs / max(n, 1)
    return out


def format_throughput(r: dict[str, Any]) -> str:
    """Human-readable lines for :func:`sampler_throughput`'s result."""
    lines = [f"fanouts {','.join(map(str, r['fanouts']))}, batch {r['batch_size']}"
             f"{', LABOR' if r['labor'] else ''}; {r['batches']} batches, {r['workers']} worker(s) x "
             f"{r['numba_threads']} numba thread(s); {r['edges_per_batch']:.0f} sampled edges and "
             f"{r['inputs_per_batch']:.0f} input nodes per batch"]
    for key, label in (("sampling", "sampling only"), ("sampling_gather", "sampling + feature gather")):
        if key in r:
            f = r[key]
            lines.append(f"{label:>26}: {f['batches_per_s']:8.1f} batches/s  {f['edges_per_s'] / 1e6:8.2f} M "
                         "sampled edges/s")
    return "\n".join(lines)
