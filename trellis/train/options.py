"""Typed options of each training strategy: one dataclass per ``--strategy``, validated by itself.

Why: a strategy's options used to be loose fields of one flat config that every strategy could see and none
owned, so the rules about them (``--buffer-parts`` needs ``--parts-dir``, ``--clusters-per-batch`` at most
``--clusters``, ``--pp-dir`` required) lived in one long validator, and a Python caller had no type telling
which options ``mini`` reads. Here each strategy's options are a frozen dataclass: its fields are the
definitions (default, help, choices) that the CLI flags and :class:`~trellis.train.config.TrainConfig`'s
fields are generated from, its :meth:`~StrategyOptions.validate` holds the strategy's rules, and an option
that belongs to another strategy is refused by name (:func:`refuse_foreign`), never silently ignored.

The run record (``config.json``, ``--set``, flags) stays flat, so runs written before keep resuming; the
typed view is :attr:`TrainConfig.options`, and the library accepts it directly
(``trellis.train(store, strategy=trellis.MiniOptions(fanouts="10,5"))``). Shared groups of options
(the partition layout, the memory budget, the batch producer) are mixins, so each flag is defined once.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Protocol

from trellis.distributed.comm import RankEnv
from trellis.errors import TrellisUserError
from trellis.loader.blocks import parse_fanouts
from trellis.utils.sizes import parse_size


class TrainConfig(Protocol):
    """What option rules read of the run's configuration (:class:`trellis.train.config.TrainConfig`)."""

    strategy: str
    layers: int
    features: str
    split_seed: int | None
    feature_norm: str

#: ``--pp-loader`` choices (trellis.loader.pp.LOADERS; auto = the placement planner's choice).
PP_LOADERS = ("auto", "naive", "naive-batch", "index", "prefetch", "chunk", "storage")

#: ``--cluster-method`` choices (partitioners of trellis.partition, and ``hash`` = balanced random).
CLUSTER_METHODS = ("metis", "grem", "hash")

#: Seconds a distributed rank waits for its peers by default (``--timeout``).
DEFAULT_TIMEOUT_S = 300.0
#: ``--samplers`` with the single-process partition buffer.
NO_BUFFER_SAMPLERS = ("--samplers with --parts-dir and one process: the partition buffer prepares its batches in "
                      "this process so far; drop --samplers (ranks, --nproc P > 1, take it)")
#: ``--feature-cache`` without ranks to cache rows of.
NO_RANKS_CACHE = "--feature-cache caches other ranks' rows: it applies with --nproc P > 1; drop it"


_BUDGET_HELP = ("full: cap on the process's peak memory (RssAnon), e.g. 3G; the graph is trained out of core in row "
                "tiles with spill files, exactly as in memory (default: none, all in memory). mini/cluster with "
                "--parts-dir: what the partition buffer plans its parts and cache in. pp: cap on the process's "
                "peak memory too; its rows and batch buffers get what the process itself and 48 MiB of head-room "
                "leave (default: 80%% of available RAM for them)")
_BATCH_SIZE_HELP = "mini/pp: target nodes (mini) or rows (pp) per batch (default: 1024; pp 8192)"


def opt(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None,
        metavar: str | None = None, resolved: bool = False) -> Any:
    """An option field with its CLI help; ``resolved`` = None until the config fills the strategy's default."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "resolved": resolved})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fanouts_text(name: str, value: Any) -> Any:
    """``[15, 10]`` as the CLI's ``"15,10"`` (a library caller's spelling); other values pass unchanged.

    Raises:
        TrellisUserError: An element that is not an integer, naming the flag.
    """
    if not isinstance(value, (list, tuple)):
        return value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TrellisUserError(f"{_flag(name)} {list(value)!r}: give integers, one per layer, target layer first "
                               "(-1 = all neighbours)")
    return ",".join(str(v) for v in value)


def _at_least(name: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise TrellisUserError(f"{_flag(name)} must be an integer >= {low} (got {value})")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(value, list(choices), n=1)
        raise TrellisUserError(f"{_flag(name)} {value!r} is not one of {', '.join(choices)}"
                               + (f"; did you mean {hint[0]!r}?" if hint else ""))


@dataclass(frozen=True, kw_only=True)
class StrategyOptions:
    """Options of one strategy (the base has none: a user-registered strategy without options)."""

    #: The ``--strategy`` these options belong to.
    strategy: ClassVar[str] = ""

    @classmethod
    def names(cls) -> frozenset[str]:
        """Field names of this strategy's options."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def of(cls, cfg: TrainConfig) -> StrategyOptions:
        """This strategy's options read from a (flat) configuration."""
        return cls(**{name: getattr(cfg, name) for name in cls.names()})

    def validate(self, cfg: TrainConfig) -> None:
        """Check the options against each other and the model; raise a user error naming the flag."""

    def given(self, name: str) -> bool:
        """Whether option ``name`` differs from its default (the user asked for it)."""
        f = next(f for f in fields(self) if f.name == name)
        return getattr(self, name) != (f.default if f.default is not MISSING else None)


#: ``--feature-residency`` choices: where a batch strategy's input rows live.
RESIDENCIES = ("host", "device", "auto")


@dataclass(frozen=True, kw_only=True)
class _Loader(StrategyOptions):
    """How batches are prepared (mini, cluster)."""

    prefetch: int = opt(2, "mini/cluster: batches prepared ahead on a background thread, 0 = none (default: 2)")
    samplers: int = opt(0, "mini/cluster: prepare batches in K worker processes (passed back through shared "
                           "memory; the same batches as in-process preparation), 0 = in this process; with "
                           "--parts-dir --nproc P > 1, K per rank (default: 0)",
                        metavar="K")
    feature_residency: str = opt("host", "mini/cluster in memory: where the input rows batches gather live. "
                                         "host: the store's rows, gathered on the CPU (by the sampler processes "
                                         "with --samplers K) and copied to --device with each batch; device: "
                                         "copied once to --device (its memory must hold them), batches carry "
                                         "node ids and the trainer gathers the rows there, so sampler processes "
                                         "only sample; auto: device when --device is a GPU whose free memory "
                                         "holds four times the rows, else host (default: host)",
                                 choices=RESIDENCIES)

    def validate(self, cfg: TrainConfig) -> None:
        _at_least("prefetch", self.prefetch, 0)
        _at_least("samplers", self.samplers, 0)
        _choice("feature_residency", self.feature_residency, RESIDENCIES)


@dataclass(frozen=True, kw_only=True)
class _Memory(StrategyOptions):
    """A memory budget."""

    memory_budget: str | None = opt(None, _BUDGET_HELP, metavar="SIZE")

    def validate(self, cfg: TrainConfig) -> None:
        if self.memory_budget is not None:
            parse_size(self.memory_budget, flag="--memory-budget")


@dataclass(frozen=True, kw_only=True)
class _Batched(StrategyOptions):
    """Targets or rows per batch."""

    batch_size: int | None = opt(None, _BATCH_SIZE_HELP, resolved=True)

    def validate(self, cfg: TrainConfig) -> None:
        _at_least("batch_size", self.batch_size, 1)


@dataclass(frozen=True, kw_only=True)
class _Budget(_Memory):
    """A memory budget and where spills go."""

    spill_dir: str | None = opt(None, "full with --memory-budget, mini/cluster with --parts-dir: where spill files "
                                      "go; they are removed when the run ends (default: RUN_DIR/spill or a "
                                      "temporary directory)", metavar="DIR")


@dataclass(frozen=True, kw_only=True)
class _Ranks(StrategyOptions):
    """Ranks started on this machine (or by torchrun) and how long they wait for each other."""

    nproc: int | None = opt(None, "ranks to start on this machine (127.0.0.1, gloo; nccl with --device cuda). "
                                  "With --parts-dir: full must equal the layout's parts (default: the number "
                                  "of parts); mini and cluster: 1 (a partition buffer, the default) up to "
                                  "the parts. pp: data-parallel over the training rows (default: 1). Under "
                                  "torchrun the launcher's ranks are used instead")
    timeout: float = opt(DEFAULT_TIMEOUT_S, "ranks (--parts-dir: full, or mini and cluster with --nproc P > 1; pp "
                                            "with --nproc P > 1): seconds a rank waits for its peers (rendezvous, "
                                            "exchanges, "
                                            "barriers) before it fails (default: 300)")

    def validate(self, cfg: TrainConfig) -> None:
        _at_least("nproc", self.nproc, 1)
        if not 1.0 <= self.timeout < float("inf"):  # below a second the rendezvous itself times out
            raise TrellisUserError(f"--timeout must be a number of seconds >= 1 (got {self.timeout})")


@dataclass(frozen=True, kw_only=True)
class _Parts(_Ranks):
    """A partitioned layout and the ranks that train it."""

    parts_dir: str | None = opt(None, "full: train partition-parallel on the partitioned layout PART_DIR (from "
                                      "`trellis partition STORE --parts P --out PART_DIR`), one rank per part; "
                                      "the result is the single process's. mini/cluster (with --nproc 1): train "
                                      "from the layout through a partition buffer, K parts resident at a time. "
                                      "mini with --nproc P > 1: data-parallel ranks, each training the targets "
                                      "of its parts; cluster with --nproc P > 1: each batch's subgraph computed "
                                      "by the ranks that own its nodes (default: none)", metavar="PART_DIR")
    def validate(self, cfg: TrainConfig) -> None:
        _Ranks.validate(self, cfg)
        if self.nproc is not None and self.parts_dir is None:
            raise TrellisUserError("--nproc needs --parts-dir PART_DIR (ranks train the parts of a partitioned "
                                   "layout; make one with `trellis partition STORE --parts P --out PART_DIR`)")


@dataclass(frozen=True, kw_only=True)
class _Buffer(_Parts, _Budget, _Loader):
    """Mini- and cluster-batch over a partition buffer (``--parts-dir``)."""

    buffer_parts: int | None = opt(None, "mini/cluster with --parts-dir: parts resident in the partition buffer, "
                                         "1..P (default: as many as --memory-budget holds; all without a budget)",
                                   metavar="K")

    def _needs_parts(self, names: Sequence[str]) -> None:
        if self.parts_dir is not None:
            return
        for name in names:
            if name in self.names() and self.given(name):
                raise TrellisUserError(
                    f"{_flag(name)} applies to --strategy {self.strategy} with --parts-dir PART_DIR (a partition "
                    f"buffer: `trellis partition STORE --out PART_DIR`); add it or drop {_flag(name)}")

    def validate(self, cfg: TrainConfig) -> None:
        _Loader.validate(self, cfg)
        _Budget.validate(self, cfg)
        _Parts.validate(self, cfg)
        _at_least("buffer_parts", self.buffer_parts, 1)
        self._needs_parts(["memory_budget", "spill_dir", "buffer_parts", "buffer_cache", "buffer_replay",
                           "buffer_replay_share", "buffer_replay_fanouts"])
        if self.samplers > 0 and self.parts_dir is not None and (self.nproc or 1) == 1:
            raise TrellisUserError(NO_BUFFER_SAMPLERS)
        if self.parts_dir is not None and cfg.features != "store":
            raise TrellisUserError(f"--features {cfg.features} with --parts-dir: --strategy {self.strategy} trains on "
                                   "the layout's node features (in one process and across ranks); drop --features "
                                   "or --parts-dir")
        if self.parts_dir is not None and self.feature_residency == "device":
            raise TrellisUserError("--feature-residency device with --parts-dir: a partitioned run reads its rows "
                                   "from the layout part by part; drop --feature-residency (or --parts-dir to "
                                   "train in memory)")


@dataclass(frozen=True, kw_only=True)
class FullOptions(_Parts, _Budget):
    """``--strategy full``: in memory, out of core (``memory_budget``) or partition-parallel (``parts_dir``)."""

    strategy: ClassVar[str] = "full"
    overlap: bool = opt(False, "full with --parts-dir: start each layer's halo exchange asynchronously and "
                               "aggregate the interior edges (local sources) while the rows travel, then the "
                               "boundary edges; the result equals the blocking schedule's (to float rounding) "
                               "(default: off)")
    staleness: int = opt(0, "full with --parts-dir: layers use halo rows and halo gradients up to S epochs old "
                            "while fresh ones travel (PipeGCN is 1); 0 = the exact synchronous engine (default: 0)",
                         metavar="S")
    emulate_link: str | None = opt(None, "full with --parts-dir: delay every exchange as a link of this rate and "
                                         "latency would (it sleeps; no CPU is used), e.g. 100MB/s,1ms (default: "
                                         "none)", metavar="RATE[,LATENCY]")

    def validate(self, cfg: TrainConfig) -> None:
        """Distributed options need ``--parts-dir``; spills need a budget; the link must parse."""
        _Budget.validate(self, cfg)
        _Parts.validate(self, cfg)
        if self.staleness < 0:
            raise TrellisUserError(f"--staleness must be 0 (exact) or a positive number of epochs (got "
                                   f"{self.staleness})")
        if self.parts_dir is None:
            for name in ("timeout", "overlap", "staleness", "emulate_link"):
                if self.given(name):
                    raise TrellisUserError(f"{_flag(name)} applies to distributed runs only: add --parts-dir "
                                           "PART_DIR (from `trellis partition STORE --parts P --out PART_DIR`) or "
                                           "drop it")
        if self.spill_dir is not None and self.memory_budget is None:
            raise TrellisUserError("--spill-dir applies to --strategy full with --memory-budget only; add "
                                   "--memory-budget SIZE or drop --spill-dir")
        if self.emulate_link is not None:
            from trellis.distributed.comm import Link

            Link.parse(self.emulate_link)


@dataclass(frozen=True, kw_only=True)
class MiniOptions(_Buffer, _Batched):
    """``--strategy mini``: neighbour-sampled mini-batches, in memory or through a partition buffer."""

    strategy: ClassVar[str] = "mini"
    fanouts: str | None = opt(None, "mini: neighbours sampled per node per layer, target layer first, -1 = all "
                                    "(default: 15,10 for 2 layers; 15,10,5,5,... for more)", metavar="F1,F2,...",
                              resolved=True)
    labor: bool = opt(False, "mini: LABOR (layer-neighbour) sampling instead of uniform (default: off)")
    buffer_cache: str | None = opt(None, "mini with --parts-dir: memory for the cache of rows outside the buffer "
                                         "most likely to be sampled, e.g. 256M; 0 = sample inside the buffer only "
                                         "(default: what --memory-budget leaves after the parts)", metavar="SIZE")

    buffer_replay: int = opt(0, "mini with --parts-dir: targets per part kept as rehearsal batches (sampled, with "
                                "their rows in 4 bits, while the part is resident; kept across epochs); every step "
                                "also trains one of each part not resident (merged into one batch), weighted as a "
                                "resident part, so states whose parts hold few classes do not skew the model; "
                                "512 brings 1 of 16 label-following parts to in-memory accuracy; "
                                "0 = off (default: 0)",
                             metavar="R")
    buffer_replay_share: float = opt(1.0, "mini with --buffer-replay: targets each step rehearses, as a fraction "
                                          "of --batch-size (spread over the parts not resident); 0.5 was 6 to 10 "
                                          "percent faster and cost 0.4 points on one planted graph (default: 1)",
                                     metavar="F")
    buffer_replay_fanouts: str | None = opt(None, "mini with --buffer-replay: fanouts of the rehearsal batches, "
                                                  "target layer first; fewer first-hop rows make a rehearsal "
                                                  "cheaper to train (default: --fanouts with the target layer's "
                                                  "halved, e.g. 5,5 for 10,5)", metavar="F1,F2")

    sampler_ranks: int = opt(0, "mini with --parts-dir --nproc P > 1: K more ranks of the job that only sample "
                                "(batches sent to the trainer ranks over torch.distributed, the same batches as "
                                "in-trainer preparation), K <= P, each serving the trainers t with t mod K = its "
                                "index; under torchrun the last K ranks (default: 0)", metavar="K")
    feature_cache: str | None = opt(None, "mini with --parts-dir --nproc P > 1: memory per rank for a cache of "
                                          "other ranks' feature rows, those most likely to be sampled (SALIENT++'s "
                                          "VIP ranking), fetched once at the start, e.g. 256M (default: none)",
                                    metavar="SIZE")

    def __post_init__(self) -> None:
        for name in ("fanouts", "buffer_replay_fanouts"):  # the library may pass [15, 10]
            object.__setattr__(self, name, fanouts_text(name, getattr(self, name)))

    def validate(self, cfg: TrainConfig) -> None:
        """The buffer's rules, and one fanout per layer."""
        _Buffer.validate(self, cfg)
        _Batched.validate(self, cfg)
        _at_least("buffer_replay", self.buffer_replay, 0)
        if not 0.0 < self.buffer_replay_share <= 8.0:
            raise TrellisUserError(f"--buffer-replay-share must be in (0, 8] (got {self.buffer_replay_share}): the "
                                   "targets a step rehearses, as a fraction of --batch-size")
        for flag in ("buffer_replay_share", "buffer_replay_fanouts"):
            if self.given(flag) and not self.buffer_replay:
                raise TrellisUserError(f"{_flag(flag)} applies to rehearsal: add --buffer-replay R (e.g. 512) or "
                                       f"drop {_flag(flag)}")
        if self.buffer_replay_fanouts is not None:
            try:
                parse_fanouts(self.buffer_replay_fanouts, cfg.layers)
            except TrellisUserError:
                raise TrellisUserError(f"--buffer-replay-fanouts {self.buffer_replay_fanouts!r}: give {cfg.layers} "
                                       "fanouts (one per layer, target layer first; -1 = all neighbours), "
                                       "e.g. 5,5") from None
        parse_fanouts(self.fanouts or "", cfg.layers)
        if self.buffer_cache is not None:
            parse_size(self.buffer_cache, flag="--buffer-cache")
        _at_least("sampler_ranks", self.sampler_ranks, 0)
        if self.sampler_ranks:
            # --nproc unset: a torchrun rank (the job's size says how many), else one process, which has no ranks
            ranks = self.nproc if self.nproc is not None else (1 if RankEnv.from_environ() is None else 2)
            if self.parts_dir is None or ranks < 2:
                raise TrellisUserError(f"--sampler-ranks {self.sampler_ranks} applies to data-parallel mini-batch "
                                       "(--parts-dir PART_DIR --nproc P > 1); add them or drop --sampler-ranks")
            if self.nproc is not None and self.sampler_ranks > self.nproc:
                raise TrellisUserError(f"--sampler-ranks {self.sampler_ranks} is more than the {self.nproc} trainer "
                                       f"ranks: each sampler rank serves at least one trainer; use --sampler-ranks "
                                       f"{self.nproc} or fewer")
            if self.samplers:
                raise TrellisUserError("--samplers with --sampler-ranks: batches come from the sampler ranks; "
                                       "drop one of them")
        if self.feature_cache is not None:
            parse_size(self.feature_cache, flag="--feature-cache")
            self._needs_parts(["feature_cache"])
            if self.nproc == 1:
                raise TrellisUserError(NO_RANKS_CACHE)


@dataclass(frozen=True, kw_only=True)
class ClusterOptions(_Buffer):
    """``--strategy cluster``: batches of merged clusters, or of the resident parts of a partition buffer."""

    strategy: ClassVar[str] = "cluster"
    clusters: int = opt(32, "cluster: number of clusters the graph is split into (default: 32)")
    clusters_per_batch: int = opt(4, "cluster: clusters merged into one batch (default: 4)")
    boundary_hops: int = opt(0, "cluster: hops of boundary neighbours added as extra sources, 0-2 (default: 0)")
    cluster_method: str = opt("metis", "cluster: partitioner making the clusters (default: metis)",
                              choices=CLUSTER_METHODS)

    def validate(self, cfg: TrainConfig) -> None:
        """The buffer's rules; clusters per batch within the clusters; no cluster options over a layout."""
        super().validate(cfg)
        _at_least("clusters", self.clusters, 1)
        _at_least("clusters_per_batch", self.clusters_per_batch, 1)
        if self.boundary_hops not in (0, 1, 2):
            raise TrellisUserError(f"--boundary-hops must be 0, 1 or 2 (got {self.boundary_hops})")
        if self.clusters_per_batch > self.clusters:
            raise TrellisUserError(f"--clusters-per-batch {self.clusters_per_batch} exceeds --clusters "
                                   f"{self.clusters}; a batch cannot hold more clusters than there are")
        _choice("cluster_method", self.cluster_method, CLUSTER_METHODS)
        if self.parts_dir is not None and (self.nproc or 1) == 1 and RankEnv.from_environ() is None:
            for name in ("clusters", "clusters_per_batch", "boundary_hops", "cluster_method"):
                if self.given(name):
                    raise TrellisUserError(f"{_flag(name)} does not apply with --parts-dir in one process: a batch is "
                                           "the buffer's resident parts (the layout's parts are the clusters); drop "
                                           "it, or train across ranks (--nproc P > 1, whose batches are clusters)")


@dataclass(frozen=True, kw_only=True)
class PPOptions(_Memory, _Batched, _Ranks):
    """``--strategy pp``: SGC/SIGN/HOGA on a pre-propagated cache."""

    strategy: ClassVar[str] = "pp"
    pp_dir: str | None = opt(None, "pp: pre-propagated cache from `trellis preprocess STORE --out PP_DIR`",
                             metavar="PP_DIR")
    pp_loader: str = opt("auto", "pp: data loader; auto = the placement planner's choice from --memory-budget "
                                 "(default: auto)", choices=PP_LOADERS)
    chunk_size: int | None = opt(None, "pp: chunk reshuffling chunk in rows, 1 = exact reshuffling (default: the "
                                       "placement's choice)")

    def validate(self, cfg: TrainConfig) -> None:
        """A cache is required; the store's features are what it was built from."""
        _Memory.validate(self, cfg)
        _Batched.validate(self, cfg)
        if cfg.features != "store":
            raise TrellisUserError(f"--features {cfg.features} does not apply to --strategy pp: it trains on the "
                                   "pre-propagated features of PP_DIR")
        if cfg.split_seed is not None:
            raise TrellisUserError("--split-seed does not apply to --strategy pp: PP_DIR holds the split it was built "
                                   "with (its train/val/test rows); drop it, or train another strategy")
        if cfg.feature_norm != "auto":
            raise TrellisUserError(f"--feature-norm {cfg.feature_norm} does not apply to --strategy pp: the features "
                                   "were normalized when PP_DIR was built (`trellis preprocess --feature-norm`); "
                                   "drop it")
        if self.pp_dir is None:
            raise TrellisUserError("--strategy pp needs --pp-dir PP_DIR (build it with `trellis preprocess "
                                   "STORE --out PP_DIR`)")
        _at_least("chunk_size", self.chunk_size, 1)
        _choice("pp_loader", self.pp_loader, PP_LOADERS)
        _Ranks.validate(self, cfg)
        if self.given("timeout") and (self.nproc or 1) < 2 and RankEnv.from_environ() is None:  # it was ignored
            raise TrellisUserError("--timeout applies to pp with --nproc P > 1 (ranks); add --nproc or drop it")


#: ``--strategy`` name -> its options (a strategy registered without options has none).
OPTIONS: dict[str, type[StrategyOptions]] = {c.strategy: c for c in (FullOptions, MiniOptions, ClusterOptions,
                                                                    PPOptions)}


def options_class(strategy: str) -> type[StrategyOptions]:
    """The options type of ``strategy`` (the empty base for a strategy that declared none)."""
    return OPTIONS.get(strategy, StrategyOptions)


def option_fields() -> dict[str, Any]:
    """Every strategy option's dataclass field by name (each defined once, in the class that owns it)."""
    out: dict[str, Any] = {}
    for cls in OPTIONS.values():
        for f in fields(cls):
            out.setdefault(f.name, f)
    return out


def refuse_foreign(cfg: TrainConfig, resolved: dict[str, Any]) -> None:
    """Refuse an option set away from its default that ``cfg.strategy`` does not read, naming who reads it.

    A resolved field (batch size, fanouts) always holds a value: its default is the one ``resolved`` gives.
    """
    own = options_class(cfg.strategy).names()
    for name, f in sorted(option_fields().items()):
        if name in own:
            continue
        if getattr(cfg, name) != (resolved.get(name) if f.metadata.get("resolved") else f.default):
            users = [s for s, c in OPTIONS.items() if name in c.names()]
            raise TrellisUserError(f"{_flag(name)} does not apply to --strategy {cfg.strategy}; it applies to "
                                   f"--strategy {' and '.join(users)} (drop it, or choose that strategy)")
