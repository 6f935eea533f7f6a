"""RowFetch: rows by global id from the ranks that own them, over three all_to_all calls on gloo ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.multiprocessing as mp

from trellis.distributed.comm import Comm, RankEnv, free_port
from trellis.distributed.rows import RowFetch

N, F = 50, 3


def _table() -> torch.Tensor:
    return torch.arange(N * F, dtype=torch.float32).view(N, F)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    comm = Comm(RankEnv(rank, world, rank, world, "127.0.0.1", port), torch.device("cpu"), 60.0)
    try:
        owner = np.arange(N) % world  # node v lives on rank v mod world
        table = _table()

        def serve(ids: np.ndarray) -> torch.Tensor:
            assert (owner[ids] == rank).all(), "a rank was asked for a row it does not own"
            return table[torch.from_numpy(ids)]

        fetch = RowFetch(comm, owner, serve, F)
        rng = np.random.default_rng(rank)
        asks = [rng.integers(0, N, 40), np.empty(0, np.int64) if rank == 1 else rng.integers(0, N, 7),
                np.array([rank, rank, (rank + 1) % N])]
        ok = all(torch.equal(fetch.fetch(ids), table[torch.from_numpy(ids)]) for ids in asks)
        stats = fetch.stats.take()
        remote = sum(int((owner[ids] != rank).sum()) for ids in asks)
        ok = ok and stats["fetch_remote_rows"] == remote and stats["fetch_recv_bytes"] == remote * (F * 4 + 8)
        # a cache of some remote rows: the same rows come back, the cached ones without a fetch
        held = fetch.fill_cache(np.arange(0, N, 2))
        cached = (np.arange(0, N, 2) % world != rank).sum()
        ok = ok and held == cached * F * 4 and fetch.stats.take()["fetch_remote_rows"] == 0
        ids = rng.integers(0, N, 30)
        ok = ok and torch.equal(fetch.fetch(ids), table[torch.from_numpy(ids)])
        stats = fetch.stats.take()
        away = owner[ids] != rank
        ok = ok and stats["fetch_cache_rows"] == int((away & (ids % 2 == 0)).sum())
        ok = ok and stats["fetch_remote_rows"] == int((away & (ids % 2 == 1)).sum())
        np.save(f"{out}-{rank}.npy", np.array([ok]))
    finally:
        comm.close()


def test_every_rank_gets_the_owners_rows_in_its_order(tmp_path):
    world = 3
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path / "ok")), nprocs=world, join=True)
    assert all(bool(np.load(tmp_path / f"ok-{r}.npy")[0]) for r in range(world))


def test_a_world_of_one_is_a_local_gather():
    comm = Comm(RankEnv(0, 1, 0, 1, "127.0.0.1", free_port()), torch.device("cpu"), 60.0)
    try:
        table = _table()
        fetch = RowFetch(comm, np.zeros(N, np.int64), lambda ids: table[torch.from_numpy(ids)], F)
        ids = np.array([4, 4, 0, 49])
        assert torch.equal(fetch.fetch(ids), table[torch.from_numpy(ids)])
        assert fetch.stats.take() == {"fetch_remote_rows": 0, "fetch_local_rows": 4, "fetch_cache_rows": 0,
                                      "fetch_recv_bytes": 0}
    finally:
        comm.close()
