"""The training configuration: one validated dataclass that the CLI, config files and run dirs share.

Why one schema: every way of configuring a run (``trellis train`` flags, ``--config FILE``,
``--set key=value``, the ``config.json`` of a run directory that ``--resume`` reads back) goes through
:class:`TrainConfig`, so a value is parsed, defaulted and validated in exactly one place and the error a
user sees always names the flag. The CLI is generated from the fields' metadata (help, choices), so a
new option is one field here.

Defaults come from the papers: GCN (Kipf & Welling 2017: hidden 16, lr 0.01, weight decay 5e-4, dropout
0.5, 200 epochs) and GAT (Veličković et al. 2018: 8 heads x 8 hidden, lr 0.005, weight decay 5e-4,
dropout 0.6, patience 100). Fields that depend on the model default to ``None`` and are filled from
:data:`MODEL_DEFAULTS` when the config is built, so ``--model gat`` alone gives the GAT paper's setup
while an explicit ``--lr`` still wins.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from trellis.errors import TrellisUserError
from trellis.nn import MODELS
from trellis.nn.init import INITS
from trellis.nn.models import JKS, MODEL_FLAGS, NORMS
from trellis.train.features import parse_features
from trellis.train.optim import OPTIMIZERS
from trellis.train.options import (
    OPTIONS,
    StrategyOptions,
    fanouts_text,
    option_fields,
    options_class,
    refuse_foreign,
)
from trellis.train.tasks import TASKS, check_metric

#: Models of the ``pp`` strategy (trellis.nn.pp_models.PP_MODELS); they train on no other strategy.
PP_MODELS = ("sgc", "sign", "hoga")

#: Per-layer fanouts when ``--fanouts`` is not given, target layer first (truncated to ``--layers``).
DEFAULT_FANOUTS = (15, 10, 5)

FEATURE_NORMS = ("auto", "none", "row", "l2")

#: The largest seed a run takes (a signed 64-bit integer: what torch's generators unpack).
MAX_SEED = 2**63 - 1

#: Hyperparameters every model starts from (the GCN paper's), overridden per model below.
BASE_DEFAULTS: dict[str, Any] = {
    "hidden": 16, "heads": 1, "dropout": 0.5, "lr": 0.01, "weight_decay": 5e-4, "epochs": 200, "patience": 100,
}

#: Per-model defaults (only the keys that differ from :data:`BASE_DEFAULTS`).
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "gcn": {},
    # GAT paper (transductive): 8 heads x 8 features, dropout 0.6 on inputs and attention, lr 0.005,
    # patience 100 (its epoch budget was unbounded; 1000 covers every Planetoid run we measured).
    "gat": {"hidden": 8, "heads": 8, "dropout": 0.6, "lr": 0.005, "epochs": 1000, "patience": 100},
    "gate": {"hidden": 8, "heads": 8, "dropout": 0.6, "lr": 0.005, "epochs": 1000, "patience": 100},
    # GraphSAGE/GIN papers are inductive/graph-level; a wider hidden layer is the common transductive setup.
    "sage": {"hidden": 64},
    "gin": {"hidden": 64},
    "mlp": {"hidden": 64},
    # Pre-propagation models (PP-GNN §6 setups): wide MLPs, no L2 penalty, large batches.
    "sgc": {"hidden": 256, "weight_decay": 0.0, "patience": 50},
    "sign": {"hidden": 256, "weight_decay": 0.0, "patience": 50},
    "hoga": {"hidden": 256, "heads": 4, "weight_decay": 0.0, "patience": 50},
}

def defaults_text(key: str) -> str:
    """``(default: 16; gat/gate 8; sage/gin/mlp 64; ...)``: a help's defaults, read from the tables above."""
    base = BASE_DEFAULTS[key]
    by_value: dict[Any, list[str]] = {}
    for model, over in MODEL_DEFAULTS.items():
        if over.get(key, base) != base:
            by_value.setdefault(over[key], []).append(model)
    rest = "".join(f"; {'/'.join(models)} {value:g}" for value, models in by_value.items())
    return f"(default: {base:g}{rest})"


#: Per-strategy defaults of fields that depend on the strategy (``None`` until resolved).
STRATEGY_DEFAULTS: dict[str, dict[str, Any]] = {"pp": {"batch_size": 8192}}

#: Fields that describe one invocation rather than the experiment: not written to ``config.json`` and
#: allowed to differ when a run is resumed.
SESSION_FIELDS = frozenset({"json", "explain", "resume", "progress", "overwrite", "timeout"})


def known_models() -> tuple[str, ...]:
    """Model names from the ``trellis.nn`` registry."""
    return tuple(MODELS)


def _f(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None, metavar: str | None = None,
       factory: Any = None, resolved: bool = False) -> Any:
    """A field with its CLI help; ``resolved`` fields start as None and get the model's or strategy's default."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "resolved": resolved}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _opt(name: str) -> Any:
    """A strategy option's field, as its strategy's options dataclass defines it (one definition)."""
    f = option_fields()[name]
    return field(default=f.default, metadata=f.metadata)


#: Options naming a directory: recorded absolute (:meth:`TrainConfig.replay_dict`).
PATH_FIELDS = ("parts_dir", "pp_dir", "spill_dir")

@dataclass
class TrainConfig:
    """Everything a training run needs; the CLI's flags are these fields (``_`` spelled ``-``).

    Per-model fields (``None`` = the model's default from :data:`MODEL_DEFAULTS`) are resolved in
    ``__post_init__``, so an instance always holds concrete values.
    """

    store: str | None = _f(None, "graph store directory (from `trellis data import|generate`)", metavar="STORE")
    model: str = _f(None, "model: gcn, sage, gin, gat, gate (GAT with edge features) or mlp; sgc, sign or hoga "
                                 "with --strategy pp (default: gcn; pp sign)", metavar="NAME", resolved=True)
    hidden: int = _f(None, "hidden width, per attention head for gat/gate " + defaults_text("hidden"), resolved=True)
    layers: int = _f(2, "number of layers (default: 2)")
    heads: int = _f(None, "attention heads of hidden layers (gat, gate, hoga) " + defaults_text("heads"), resolved=True)
    norm: str = _f("none", "normalization of each hidden layer's output before the activation: none, layer or "
                           "batch (default: none)", choices=NORMS)
    residual: bool = _f(False, "hidden layers add their input (projected where widths differ) (default: off)")
    pre_norm: bool = _f(False, "gcn/sage/gin: pre-norm residual blocks (Platonov et al. 2023's GCN): a linear input "
                               "layer to --hidden, then each of --layers graph layers adds "
                               "act(conv(dropout(norm(h)))) to h, then norm and a linear output layer; --norm "
                               "picks the norm (default: off)")
    jk: str = _f("none", "jumping knowledge: every layer hidden-wide, a linear map reads their outputs "
                         "concatenated (cat) or their maximum (max) (default: none)", choices=JKS)
    mlp_hidden: int = _f(0, "gin: hidden width of each layer's MLP (default: 0 = the layer's width)")
    edge_weight: bool = _f(False, "gcn/sage: use the store's edge weights, which must be non-negative (PyG's "
                                  "edge_weight: weighted GCN normalization, weighted mean) (default: off)")
    dropout: float = _f(None, "dropout before every layer " + defaults_text("dropout"), resolved=True)
    lr: float = _f(None, "learning rate " + defaults_text("lr"), resolved=True)
    weight_decay: float = _f(None, "L2 penalty " + defaults_text("weight_decay"), resolved=True)
    epochs: int = _f(None, "maximum epochs per run " + defaults_text("epochs"), resolved=True)
    patience: int = _f(None, "stop a run after this many epochs without a better validation metric "
                                    + defaults_text("patience"), resolved=True)
    eval_every: int = _f(1, "evaluate every N epochs (and after the last one); patience still counts epochs. "
                            "Exact evaluation of a large graph can cost as much as an epoch (default: 1)")
    runs: int = _f(1, "repeat with seeds seed..seed+runs-1 and report mean and std (default: 1)")
    seed: int = _f(0, "seed of the first run (default: 0)")
    device: str = _f("auto", "auto (cuda when available), cpu, cuda or cuda:N (default: auto)",
                     metavar="{auto,cpu,cuda,cuda:N}")
    out: str | None = _f(None, "run directory (default: runs/<store>-<model>-<time>)", metavar="RUN_DIR")
    checkpoint_every: int = _f(50, "write a checkpoint every N epochs, 0 = only on SIGINT/SIGTERM and between "
                                   "runs (default: 50)")
    optimizer: str = _f("adam", "optimizer by name (default: adam)", choices=tuple(OPTIMIZERS))
    momentum: float | None = _f(None, "momentum of sgd (default: 0.9) and the first-moment decay beta1 of "
                                      "adam/adamw (default: 0.9); adagrad has none")
    init: str = _f("default", "weight initialization: default (each layer's own), xavier (Glorot) or he "
                              "(Kaiming) (default: default)", choices=INITS)
    features: str = _f("store", "node inputs: store = the store's features; none = one constant input; degree = "
                                "a degree encoding; embedding:D = a learnable D-wide table with sparse gradients "
                                "(default: store)", metavar="{store,none,degree,embedding:D}")
    optimizer_args: dict[str, Any] = _f(help="extra optimizer options as JSON, e.g. '{\"momentum\": 0.8}' "
                                             "(default: {})", factory=dict, metavar="JSON")
    model_args: dict[str, Any] = _f(help="extra model options as JSON, beyond the flags, e.g. '{\"out_heads\": 8}' for "
                                         "gat/gate (default: {})",
                                    factory=dict, metavar="JSON")
    task: str = _f("auto", "prediction task; auto = the store's (default: auto)", choices=("auto", *TASKS))
    metric: str | None = _f(None, "metric for early stopping and the summary: acc, f1_macro (multiclass); auc, "
                                  "acc, f1 (binary); f1_micro, f1_macro, auc_macro, acc (multilabel) (default: "
                                  "the task's: acc, auc, f1_micro)", metavar="NAME")
    target_acc: float | None = _f(None, "target of the selection metric on validation, in (0, 1]: the summary "
                                        "reports each run's time and epochs to reach it (default: none)",
                                  metavar="X")
    split_seed: int | None = _f(None, "re-draw the store's per-class split (Shchur et al.'s npz protocol) with this "
                                      "seed, as `trellis data import --split-seed` would, or train on fixed split N "
                                      "of a store that holds several (Platonov et al.'s npz files, PyG's [N, S] masks) "
                                      "(default: the store's split)", metavar="N")
    feature_norm: str = _f("auto", "feature normalization: row = divide each row by its L1 norm (the GCN "
                                   "paper's), l2 = by its L2 norm, none, or auto = chosen from the features: row "
                                   "for bag-of-words rows, l2 for rows with many active words (L1 would shrink "
                                   "them too far), none for dense or signed features (default: auto)",
                           choices=FEATURE_NORMS)
    strategy: str = _f("full", "training strategy: full = full-batch, mini = neighbour-sampled mini-batches, "
                               "cluster = cluster-batches, pp = pre-propagation (default: full); the choices are "
                               "the registered strategies (trellis.train.strategies)")
    # Strategy options: defined (default, help, rules) by their strategy's dataclass in trellis.train.options.
    fanouts: str = _opt("fanouts")
    batch_size: int = _opt("batch_size")
    labor: bool = _opt("labor")
    clusters: int = _opt("clusters")
    clusters_per_batch: int = _opt("clusters_per_batch")
    boundary_hops: int = _opt("boundary_hops")
    cluster_method: str = _opt("cluster_method")
    pp_dir: str | None = _opt("pp_dir")
    pp_loader: str = _opt("pp_loader")
    chunk_size: int | None = _opt("chunk_size")
    memory_budget: str | None = _opt("memory_budget")
    spill_dir: str | None = _opt("spill_dir")
    parts_dir: str | None = _opt("parts_dir")
    buffer_parts: int | None = _opt("buffer_parts")
    buffer_cache: str | None = _opt("buffer_cache")
    buffer_replay: int = _opt("buffer_replay")
    buffer_replay_share: float = _opt("buffer_replay_share")
    buffer_replay_fanouts: str | None = _opt("buffer_replay_fanouts")
    feature_cache: str | None = _opt("feature_cache")
    nproc: int | None = _opt("nproc")
    timeout: float = _opt("timeout")
    overlap: bool = _opt("overlap")
    staleness: int = _opt("staleness")
    emulate_link: str | None = _opt("emulate_link")
    prefetch: int = _opt("prefetch")
    samplers: int = _opt("samplers")
    feature_residency: str = _opt("feature_residency")
    sampler_ranks: int = _opt("sampler_ranks")
    price_per_hour: str | None = _f(None, "price the run: dollars per machine-hour (one rank per machine), e.g. 0.34, "
                                          "or per resource-hour, e.g. core=0.0425,gib=0.0057; summary.json gets "
                                          "cost_per_epoch_usd and value = 1 / (epoch time x cost) (default: none)",
                                    metavar="PRICE")
    deterministic: bool = _f(False, "force deterministic torch kernels (bit-exact resume on GPU; slower) "
                                    "(default: off)")
    json: bool = _f(False, "print the summary as one JSON line at the end of stdout (default: off)")
    explain: bool = _f(False, "print the model's operator plan (FLOPs, bytes per layer) and exit (default: off)")
    progress: bool = _f(True, "show a progress bar per run on stderr when it is a terminal (default: on)")
    overwrite: bool = _f(False, "replace an existing run directory (default: off)")
    resume: str | None = _f(None, "continue the killed run in RUN_DIR with its saved config", metavar="RUN_DIR")

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = "sign" if self.strategy == "pp" else "gcn"
        defaults = {**BASE_DEFAULTS, **MODEL_DEFAULTS.get(self.model, {})}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key, value in STRATEGY_DEFAULTS.get(self.strategy, {}).items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key, value in self._resolved_defaults().items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        self.validate()

    def _resolved_defaults(self) -> dict[str, Any]:
        """What the resolved fields (``batch_size``, ``fanouts``) hold when not given, for this strategy and depth."""
        out: dict[str, Any] = {"batch_size": 1024}
        if isinstance(self.layers, int) and self.layers >= 1:
            extra = max(0, self.layers - len(DEFAULT_FANOUTS))
            out["fanouts"] = ",".join(map(str, list(DEFAULT_FANOUTS[: self.layers]) + [DEFAULT_FANOUTS[-1]] * extra))
        return {**out, **{k: v for k, v in STRATEGY_DEFAULTS.get(self.strategy, {}).items() if k in out}}

    # ---- validation ----------------------------------------------------------------------------
    def _validate_model_options(self) -> None:
        """Model options only the models that read them accept (a silently ignored option is a wrong run)."""
        if self.norm not in NORMS:
            raise TrellisUserError(_choice_msg("norm", self.norm, NORMS))
        if self.jk not in JKS:
            raise TrellisUserError(_choice_msg("jk", self.jk, JKS))
        _check_range("mlp_hidden", self.mlp_hidden, 0)
        stack = self.model not in (*PP_MODELS, "mlp")
        for name, on in (("norm", self.norm != "none"), ("residual", self.residual), ("jk", self.jk != "none")):
            if on and not stack:
                raise TrellisUserError(f"--{name} applies to message-passing models, not --model {self.model}")
        if self.pre_norm and self.model not in ("gcn", "sage", "gin"):
            raise TrellisUserError(f"--pre-norm builds gcn, sage and gin blocks (got --model {self.model})")
        if self.pre_norm and self.jk != "none":
            raise TrellisUserError("--pre-norm blocks end in their own output layer; drop --jk")
        flags = [k for k in MODEL_FLAGS if k != "edge_dim" and k in self.model_args]  # edge_dim: from the store
        if flags:
            raise TrellisUserError(f"--model-args {flags[0]}: it is a flag of its own; pass "
                                   f"--{flags[0].replace('_', '-')} (a Python caller: {flags[0]}=...) instead")
        if self.heads != 1 and self.model in ("gcn", "sage", "gin", "mlp", "sgc", "sign"):
            raise TrellisUserError(f"--heads applies to attention models (gat, gate, hoga), not --model {self.model}")
        if self.model == "sgc":  # one linear layer over the cache's last hop: these would be ignored
            sgc = {**BASE_DEFAULTS, **MODEL_DEFAULTS["sgc"], "layers": 2}
            for name in ("hidden", "layers", "dropout"):
                if getattr(self, name) != sgc[name]:
                    raise TrellisUserError(
                        f"--{name} does nothing for --model sgc (one linear layer over the cache's last hop; its "
                        f"hops come from `trellis preprocess --hops`); drop it, or use --model sign for a "
                        f"{'deeper or wider' if name != 'dropout' else 'regularized'} MLP (input dropout of "
                        f"sgc: --model-args '{{\"input_dropout\": P}}')")
        if self.mlp_hidden and self.model != "gin":
            raise TrellisUserError(f"--mlp-hidden is GIN's MLP width; --model {self.model} has no such MLP")
        if self.edge_weight and self.model not in ("gcn", "sage"):
            raise TrellisUserError(f"--edge-weight applies to gcn and sage (got --model {self.model})")

    def validate(self) -> None:
        """Check every field; raise :class:`TrellisUserError` naming the flag and the fix."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        models = (*known_models(), *PP_MODELS)
        if self.model not in models:
            raise TrellisUserError(_choice_msg("model", self.model, models))
        _check_range("hidden", self.hidden, 1)
        _check_range("layers", self.layers, 1)
        _check_range("heads", self.heads, 1)
        _check_range("epochs", self.epochs, 1)
        _check_range("patience", self.patience, 1)
        _check_range("eval_every", self.eval_every, 1)
        _check_range("runs", self.runs, 1)
        _check_range("seed", self.seed, 0)
        if self.seed + self.runs - 1 > MAX_SEED:  # torch's generators take 64-bit seeds; each run seeds seed + r
            raise TrellisUserError(f"--seed must be at most {MAX_SEED - self.runs + 1} with --runs {self.runs} "
                                   f"(got {self.seed})")
        _check_range("checkpoint_every", self.checkpoint_every, 0)
        if not 0.0 <= self.dropout < 1.0:
            raise TrellisUserError(f"--dropout must be in [0, 1) (got {self.dropout})")
        if not self.lr > 0.0 or self.lr != self.lr or self.lr == float("inf"):
            raise TrellisUserError(f"--lr must be a positive finite number (got {self.lr})")
        if not 0.0 <= self.weight_decay < float("inf"):
            raise TrellisUserError(f"--weight-decay must be a finite number >= 0 (got {self.weight_decay})")
        if self.momentum is not None:
            if not 0.0 <= self.momentum < 1.0:
                raise TrellisUserError(f"--momentum must be in [0, 1) (got {self.momentum})")
            if self.optimizer == "adagrad":
                raise TrellisUserError("--momentum does not apply to --optimizer adagrad (it has no momentum); "
                                       "drop --momentum or choose sgd, adam or adamw")
        parse_features(self.features)
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:  # also refuses NaN
            raise TrellisUserError(f"--target-acc must be in (0, 1] (got {self.target_acc})")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise TrellisUserError(f"--device must be auto, cpu, cuda or cuda:N (got {self.device!r})")
        _check_range("batch_size", self.batch_size, 1)
        self._validate_model_options()
        if (self.strategy == "pp") != (self.model in PP_MODELS):
            raise TrellisUserError(
                f"--model {self.model} trains on the pre-propagation strategy only: add --strategy pp --pp-dir "
                "PP_DIR" if self.model in PP_MODELS else
                f"--strategy pp trains {', '.join(PP_MODELS)} (got --model {self.model})")
        if self.price_per_hour is not None:
            from trellis.plan.price import Price

            Price.parse(self.price_per_hour)
        refuse_foreign(self, self._resolved_defaults())
        self.options.validate(self)
        for name in ("optimizer", "task", "feature_norm", "init"):
            choices = _field_meta(name)["choices"]
            if getattr(self, name) not in choices:
                raise TrellisUserError(_choice_msg(name, getattr(self, name), choices))
        if self.metric is not None:
            allowed = (TASKS[self.task].metric_names if self.task != "auto"
                       else tuple(sorted({m for t in TASKS.values() for m in t.metric_names})))
            if self.metric not in allowed:
                if self.task != "auto":
                    check_metric(self.task, self.metric)  # names the task and the tasks the metric fits
                raise TrellisUserError(_choice_msg("metric", self.metric, allowed))
        if self.store is None and self.resume is None:
            raise TrellisUserError("STORE is required (a graph store directory), or --resume RUN_DIR")

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> TrainConfig:
        """Build from a mapping whose values may be strings (parsed per field type) or JSON values.

        Args:
            values: Field name -> value; unknown names are refused with a did-you-mean hint. The strategy's
                options may come nested: ``strategy`` as a :class:`~trellis.train.options.StrategyOptions`
                (``MiniOptions(fanouts="10,5")``), or a table named after the strategy (``{"strategy": "mini",
                "mini": {"fanouts": "10,5"}}``, a TOML file's ``[mini]``).
            source: Where the values came from, for error messages (e.g. the config file's path).
        """
        return cls(**typed_values(flatten_options(values, source), source))

    @property
    def options(self) -> StrategyOptions:
        """The typed options of :attr:`strategy` (e.g. :class:`~trellis.train.options.MiniOptions`)."""
        return options_class(self.strategy).of(self)

    def replay_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with the store and every path option absolute.

        What a run's or a sweep's ``config.json`` records, so ``--resume`` and ``trellis train --config`` work
        from any directory.
        """
        d = self.to_dict()
        for key in ("store", *PATH_FIELDS):
            if d.get(key):
                d[key] = str(Path(str(d[key])).resolve())
        return d

    def to_dict(self, *, session: bool = False) -> dict[str, Any]:
        """JSON-ready values; ``session=False`` leaves out per-invocation fields (:data:`SESSION_FIELDS`)."""
        d = dataclasses.asdict(self)
        if not session:
            for name in SESSION_FIELDS:
                d.pop(name, None)
        return d

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``trellis.nn.build_model`` (besides name, in_dim, out_dim)."""
        options = {"norm": self.norm, "residual": self.residual, "jk": self.jk, "mlp_hidden": self.mlp_hidden,
                   "edge_weight": self.edge_weight, "pre_norm": self.pre_norm}
        defaults = {"norm": "none", "residual": False, "jk": "none", "mlp_hidden": 0, "edge_weight": False,
                    "pre_norm": False}
        return {"hidden": self.hidden, "layers": self.layers, "heads": self.heads, "dropout": self.dropout,
                **{k: v for k, v in options.items() if v != defaults[k]}, **self.model_args}


def flatten_options(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Nested strategy options (an options object, or a table named after the strategy) as flat fields.

    Raises:
        TrellisUserError: A table for another strategy than the one chosen, an option its strategy does not
            have, or an option given both nested and flat.
    """
    out = dict(values)
    strategy = out.get("strategy")
    if strategy is not None and not isinstance(strategy, (str, StrategyOptions)):
        raise TrellisUserError(f"{source}: strategy= takes a name ({', '.join(OPTIONS)}) or an options object "
                               f"(trellis.MiniOptions(...)); got a {type(strategy).__name__}")
    nested: dict[str, Any] = {}
    if isinstance(strategy, StrategyOptions):
        out["strategy"] = strategy.strategy
        nested = {f.name: getattr(strategy, f.name) for f in fields(strategy) if strategy.given(f.name)}
        where = f"{type(strategy).__name__}(...)"
    for name in [k for k in out if k in OPTIONS and isinstance(out[k], dict)]:
        table = out.pop(name)
        if out.get("strategy", "full") != name:
            raise TrellisUserError(f"{source}: options for --strategy {name} given, but the strategy is "
                                   f"{out.get('strategy', 'full')!r}; set strategy = {name!r} or drop them")
        own = OPTIONS[name].names()
        for key in table:
            if key.replace("-", "_") not in own:
                hint = difflib.get_close_matches(key.replace("-", "_"), sorted(own), n=1)
                raise TrellisUserError(f"{source}: [{name}] has no option {key!r}"
                                       + (f"; did you mean {hint[0]!r}?" if hint else "")
                                       + f" ({name}'s options: {', '.join(sorted(own))})")
        nested = {key.replace("-", "_"): value for key, value in table.items()}
        where = f"[{name}]"
    for key, value in nested.items():
        if key in out or key.replace("_", "-") in out:
            raise TrellisUserError(f"{source}: {flag(key)} is given both in {where} and on its own; give it once")
        out[key] = value
    return out


def check_keys(values: dict[str, Any], source: str) -> None:
    """Refuse option names that are not fields (``-`` and ``_`` both accepted), with a did-you-mean hint."""
    names = {f.name for f in fields(TrainConfig)}
    for key in values:
        name = key.replace("-", "_")
        if name not in names:
            hint = difflib.get_close_matches(name, sorted(names), n=1)
            raise TrellisUserError(
                f"{source}: unknown option {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                + " (see `trellis train --help`)")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a ``--config`` file: JSON (``.json``, including a run's ``config.json``) or TOML (``.toml``)."""
    p = Path(path)
    if not p.is_file():
        raise TrellisUserError(f"--config {p}: no such file")
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TrellisUserError(f"--config {p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'} ({exc})") \
            from exc
    if not isinstance(data, dict):
        raise TrellisUserError(f"--config {p}: must hold an object of option names to values")
    return flatten_options(data, f"--config {p}")


# ---- per-field parsing ------------------------------------------------------------------------------
@cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _field_meta(name: str) -> dict[str, Any]:
    return dict(next(f for f in fields(TrainConfig) if f.name == name).metadata)


def flag(name: str) -> str:
    """The CLI flag of field ``name`` (``weight_decay`` -> ``--weight-decay``)."""
    return "STORE" if name == "store" else "--" + name.replace("_", "-")


def base_type(name: str) -> tuple[type, bool]:
    """``(type, optional)`` of a field: ``int | None`` -> ``(int, True)``; ``dict[str, Any]`` -> ``(dict, False)``.

    A field resolved from the model's or strategy's defaults (``hidden``, ``lr``, ...) is optional too: ``none``
    asks for the default.
    """
    hint = _hints()[name]
    optional = bool(_field_meta(name).get("resolved"))
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = optional or len(args) < len(typing.get_args(hint))
        hint = args[0]
    origin = typing.get_origin(hint)
    return (origin or hint), optional


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(name: str, text: str) -> Any:
    """Parse the string ``text`` for field ``name`` (from a flag, ``--set`` or a config file).

    Raises:
        TrellisUserError: The value does not parse; the message names the flag.
    """
    typ, optional = base_type(name)
    s = text.strip()
    if optional and s.lower() in ("none", "null", ""):
        return None
    try:
        if typ is bool:
            if s.lower() in _TRUE:
                return True
            if s.lower() in _FALSE:
                return False
            raise ValueError
        if typ is int:
            return int(s)
        if typ is float:
            return float(s)
        if typ is dict:
            value = json.loads(s)
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, json.JSONDecodeError):
        kind = {bool: "true or false", int: "an integer", float: "a number",
                dict: "a JSON object like '{\"key\": 1}'"}[typ]
        raise TrellisUserError(f"{flag(name)} must be {kind} (got {text!r})") from None
    return s


def typed_values(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Field name -> typed value: strings parsed per field type, JSON values coerced (what a config holds).

    Why: the same setting given as ``--set layers=3`` and as ``base={"layers": 3}`` must be recorded, compared and
    resumed as one value.

    Raises:
        TrellisUserError: An unknown name (``source`` says where it came from) or a value that does not parse.
    """
    check_keys(values, source)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        out[name] = parse_value(name, value) if isinstance(value, str) else _coerce(name, value)
    return out


def _coerce(name: str, value: Any) -> Any:
    """Accept JSON values of the right kind, and a library caller's spellings of the CLI's strings.

    An int where a float is expected; a byte count as an int where a size is (``memory_budget=2_000_000_000``);
    fanouts as a list (``fanouts=[10, 5]``).
    """
    typ, _ = base_type(name)
    number = isinstance(value, int) and not isinstance(value, bool)
    if typ is float and number:
        return float(value)
    if typ is str and number and _field_meta(name).get("metavar") == "SIZE":
        return str(value)
    if name in ("fanouts", "buffer_replay_fanouts"):
        return fanouts_text(name, value)
    return value


def _check_type(name: str, value: Any) -> None:
    typ, optional = base_type(name)
    if value is None:
        if optional:
            return
        raise TrellisUserError(f"{flag(name)} needs a value")
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise TrellisUserError(f"{flag(name)} must be of type {typ.__name__} (got {value!r})")


def _check_range(name: str, value: int, low: int) -> None:
    if value < low:
        raise TrellisUserError(f"{flag(name)} must be an integer >= {low} (got {value})")


def _choice_msg(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> str:
    hint = difflib.get_close_matches(str(value), list(choices), n=1)
    return (f"{flag(name)} {value!r} is not one of {', '.join(choices)}"
            + (f"; did you mean {hint[0]!r}?" if hint else ""))
