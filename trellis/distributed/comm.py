"""A rank's view of the job: who it is (from the environment, as ``torchrun`` sets it) and its process groups.

Why three groups: collectives issued in different orders on one gloo group hang. Halo traffic runs inside
autograd (forward and backward of every layer) while the gradient all-reduce runs after it and the metric
gathers after that; each gets its own group, so a rank that is one collective ahead on one kind never
matches a peer's collective of another kind. The control group is always gloo, because
``monitored_barrier`` (the barrier that names the rank that did not arrive) exists only there.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from trellis.errors import RankRefused, TrellisUserError
from trellis.utils.sizes import parse_size

T = TypeVar("T")

#: Environment variables every PyTorch launcher sets (``torchrun``, and ``trellis train --nproc``).
ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """Rank, world size and rendezvous address of this process, read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0

    @classmethod
    def from_environ(cls) -> RankEnv | None:
        """The launcher's variables, or None when this process was not started as a rank."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        missing = [k for k in ENV_KEYS if k not in os.environ]
        if missing:
            raise TrellisUserError(f"a distributed rank needs the environment variables {', '.join(ENV_KEYS)}; "
                                   f"{', '.join(missing)} unset (start ranks with `trellis train --nproc P` or "
                                   "`torchrun`)")
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", rank))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            port = int(os.environ["MASTER_PORT"])
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as exc:
            raise TrellisUserError(f"bad distributed environment variable: {exc}") from None
        if not 0 <= rank < world:
            raise TrellisUserError(f"RANK={rank} outside [0, WORLD_SIZE={world})")
        return cls(rank, world, local, local_world, os.environ["MASTER_ADDR"], port, restarts)


_LATENCY = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|µs)?\s*")


@dataclass(frozen=True)
class Link:
    """An emulated network link: each exchange takes ``latency + bytes / rate`` at least (``--emulate-link``).

    Why: on one host loopback moves rows at memory speed, so overlapping an exchange with compute shows
    nothing. An exchange over an emulated link completes no earlier than its start plus this delay; the rank
    *sleeps* for what remains when it needs the rows (no CPU is burnt, so on 2 cores compute is not slowed),
    and an exchange that overlapped enough compute costs nothing more.

    Attributes:
        rate: Bytes per second.
        latency_s: Seconds per exchange.
    """

    rate: float
    latency_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """``RATE[,LATENCY]``: ``100MB/s,1ms``, ``1GB/s``, ``12.5MB/s,50us`` (rate decimal or binary units per second).

        Raises:
            TrellisUserError: Naming ``--emulate-link`` and the form it takes.
        """
        rate_text, _, lat_text = str(text).partition(",")
        rate_text = rate_text.strip()
        rate_text = rate_text[:-2] if rate_text.lower().endswith("/s") else rate_text
        hint = "write RATE[,LATENCY], e.g. 100MB/s,1ms or 1GB/s"
        try:
            rate = float(parse_size(rate_text, flag="--emulate-link"))
        except TrellisUserError:
            raise TrellisUserError(f"--emulate-link {text!r}: cannot read the rate; {hint}") from None
        latency = 0.0
        if lat_text.strip():
            m = _LATENCY.fullmatch(lat_text)
            if not m:
                raise TrellisUserError(f"--emulate-link {text!r}: cannot read the latency {lat_text.strip()!r}; {hint}")
            latency = float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}[m.group(2)]
        if rate <= 0:
            raise TrellisUserError(f"--emulate-link {text!r}: the rate must be positive; {hint}")
        return cls(rate, latency)

    def delay(self, nbytes: int) -> float:
        """Seconds an exchange of ``nbytes`` (the larger of what a rank sends and receives) takes on the link."""
        return self.latency_s + float(nbytes) / self.rate


@dataclass
class CommClock:
    """Where a rank's time went, per step: in exchanges (``comm_s``) and blocked waiting for them (``blocked_s``).

    ``comm_s`` sums each exchange's duration, from its start (on an emulated link: from when the link is free
    for it) until its rows are there: the transport's
    completion (a callback on the collective's future) or the emulated link's deadline, whichever is later.
    ``blocked_s`` is the time the rank spent waiting in :meth:`~trellis.distributed.halo.Pending.wait`; a
    step's local compute time is its wall time minus that.
    """

    comm_s: float = 0.0
    blocked_s: float = 0.0
    #: When the emulated link is free again (``perf_counter`` time): exchanges share one link per rank.
    link_free_at: float = 0.0

    def take(self) -> tuple[float, float]:
        """``(comm_s, blocked_s)`` since the last call; then reset."""
        out = (self.comm_s, self.blocked_s)
        self.comm_s = self.blocked_s = 0.0
        return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bind port 0 and read what the kernel chose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_threads(local_world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores shared among the ranks on it (at least one)."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


class Comm:
    """The process groups of one rank (created by :meth:`init`, destroyed by :meth:`close`).

    Attributes:
        env: Who this rank is.
        backend: ``gloo`` (CPU) or ``nccl`` (one GPU per rank).
        halo: Group of the halo exchange (inside autograd).
        link: The emulated link of ``--emulate-link`` (None: none).
        clock: Time in exchanges and blocked on them.
        grads: Group of the gradient all-reduce and the loss sum.
        control: Gloo group of barriers, metric gathers and agreement on stopping.
    """

    def __init__(self, env: RankEnv, device: torch.device, timeout_s: float, link: Link | None = None,
                 members: int | None = None) -> None:
        self.env = env
        #: Ranks ``0..members-1`` form this object's groups (the trainers); the job's other ranks (sampler ranks)
        #: create the same groups without joining them, and talk to the trainers point to point.
        self.members = env.world_size if members is None else int(members)
        self.device = device
        #: The emulated link every exchange runs over (None: the transport as it is).
        self.link = link
        #: Time in exchanges this step.
        self.clock = CommClock()
        self.timeout = timedelta(seconds=float(timeout_s))
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        #: Whether this object created the default group (and so destroys it on close); a caller that
        #: initialized torch.distributed itself keeps its group across runs.
        self.owns_default = not dist.is_initialized()
        if self.owns_default:
            dist.init_process_group(self.backend, store=self._store(env), rank=env.rank,
                                    world_size=env.world_size, timeout=self.timeout)
        ranks = None if self.members == env.world_size else list(range(self.members))
        self.halo = dist.new_group(ranks=ranks, backend=self.backend, timeout=self.timeout)
        self.grads = dist.new_group(ranks=ranks, backend=self.backend, timeout=self.timeout)
        self.control = dist.new_group(ranks=ranks, backend="gloo", timeout=self.timeout)

    def _store(self, env: RankEnv) -> dist.Store:
        """The rendezvous store, its keys prefixed by the restart count.

        Under torchrun the agent serves the store (every rank is a client) and it outlives a restart: without
        the prefix, a restarted job's process groups would read the addresses its dead predecessors published
        and fail to connect. Otherwise rank 0 serves it.
        """
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0 and not agent, timeout=self.timeout,
                              wait_for_workers=not agent)
        return dist.PrefixStore(f"trellis/attempt-{env.restart_count}", store)

    @property
    def rank(self) -> int:
        """This rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in this object's groups (the trainers)."""
        return self.members

    def barrier(self, what: str) -> None:
        """Wait for every rank; a rank that does not arrive within the timeout is named in the error."""
        try:
            dist.monitored_barrier(group=self.control, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {self.rank}: {what}: {exc}") from None

    def all_reduce_grads(self, params: list[torch.Tensor]) -> None:
        """Sum every parameter's gradient over the ranks (one flat buffer, one all-reduce)."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.world_size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.grads)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()

    def average_buffers(self, module: torch.nn.Module) -> None:
        """Make every rank's buffers the same: floating ones averaged over the ranks, the others rank 0's.

        Floating buffers are normalization statistics, the others batch counters. Why: each rank's batch
        normalization tracks running statistics of its own batches, so replicas with equal weights would still
        evaluate differently, and the model rank 0 saves would not be the one evaluated.
        """
        if self.world_size == 1:
            return
        floats = [b for b in module.buffers() if b.is_floating_point()]
        if floats:
            flat = torch.cat([b.detach().reshape(-1) for b in floats])
            dist.all_reduce(flat, group=self.grads)
            flat /= self.world_size
            at = 0
            for b in floats:
                b.copy_(flat[at:at + b.numel()].view_as(b))
                at += b.numel()
        for b in module.buffers():
            if not b.is_floating_point():
                dist.broadcast(b, src=0, group=self.grads)

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sum of ``values`` over the ranks (float64, on the control group)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.control)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (agreement on stopping)."""
        return bool(self.sum([1.0 if flag else 0.0])[0] > 0)

    def all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (first dimensions may differ; the rest must agree), on the control group."""
        t = t.detach().to("cpu").contiguous()
        if self.world_size == 1:
            return [t]
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(counts, torch.tensor([t.shape[0]], dtype=torch.int64), group=self.control)
        most = int(max(int(c) for c in counts))
        padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype)
        padded[: t.shape[0]] = t
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.control)
        return [o[: int(c)] for o, c in zip(out, counts)]

    def refuse_together(self, check: Callable[[], T]) -> T:
        """``check()`` on every rank; if it refuses bad input on any, every rank raises and one prints why.

        Why: a check of a rank's own share (its parts under the per-rank budget) refused on some ranks, or on
        all with different numbers; each printed its own line and the launcher added "rank r died". Now the
        ranks exchange whether they refused and how much they need (:class:`~trellis.errors.BudgetTooSmall`):
        the rank that needs the most (else the lowest that refused) raises its error, which names what
        satisfies every rank, and the others raise :class:`~trellis.errors.RankRefused` (exit 2, silently).
        Every rank must call it at the same point (it is a collective on the control group).
        """
        error: TrellisUserError | None = None
        try:
            result = check()
        except TrellisUserError as exc:
            error = exc
        if self.world_size == 1:
            if error is not None:
                raise error
            return result
        mine = torch.tensor([[1.0 if error is not None else 0.0, float(getattr(error, "need", 0))]],
                            dtype=torch.float64)
        votes = torch.cat(self.all_gather_rows(mine))
        refused = torch.nonzero(votes[:, 0] > 0).flatten().tolist()
        if not refused:
            return result
        speaker = max(refused, key=lambda r: (float(votes[r, 1]), -r))
        if self.rank == speaker:
            assert error is not None
            raise error
        raise RankRefused(f"rank {speaker} refused the input (its error says why)")

    def close(self) -> None:
        """Destroy this rank's groups (and the default group when this object created it)."""
        if not dist.is_initialized():
            return
        if self.owns_default:
            dist.destroy_process_group()
        else:
            for g in (self.halo, self.grads, self.control):
                dist.destroy_process_group(g)
