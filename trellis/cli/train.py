"""``trellis train`` and ``trellis predict``.

The flags of ``trellis train`` are generated from :class:`trellis.train.config.TrainConfig`: one flag per
field (``weight_decay`` -> ``--weight-decay``, booleans as ``--json/--no-json``), with the field's help.
Values are layered, later wins: field defaults (per-model where marked), ``--config FILE`` (JSON or TOML;
a run's ``config.json`` works), explicit flags, then ``--set KEY=VALUE ...``. Every value is parsed and
validated by the config class itself, so a bad one is one line naming the flag and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from trellis.cli.args import int_at_least
from trellis.cli.commands import help_of
from trellis.errors import REFUSAL_DIR_ENV, TrellisUserError, launcher_refusal
from trellis.train.build import check_registered
from trellis.train.config import SESSION_FIELDS, TrainConfig, base_type, check_keys, flag, load_config_file
from trellis.train.options import OPTIONS
from trellis.train.strategies import STRATEGIES

#: Fields that may be given again with ``--resume``: per-invocation ones, the store path (its content is
#: checked against the run's) and the device.
RESUME_ALLOWED = SESSION_FIELDS | {"store", "device"}

_EPILOG = """\
examples:
  trellis train STORE                              GCN with the GCN paper's hyperparameters
  trellis train STORE --model gat --runs 10        GAT paper setup, 10 seeds, mean and std
  trellis train STORE --set lr=0.005 hidden=64     overrides as KEY=VALUE
  trellis train --config RUN_DIR/config.json --out NEW_DIR   repeat a run
  trellis train --resume RUN_DIR                   continue a killed run exactly
  trellis train STORE --strategy pp --pp-dir PP_DIR --model sign   SIGN from `trellis preprocess` output
"""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one argument per :class:`TrainConfig` field; unset flags stay absent from the namespace.

    A strategy's options are listed under a heading naming the strategies that read them (their dataclasses
    in :mod:`trellis.train.options`), so ``--help`` reads as the options of each strategy.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        owners = tuple(s for s, c in OPTIONS.items() if f.name in c.names())
        target: Any = parser
        if owners:
            title = "options of --strategy " + " and ".join(owners)
            target = groups.setdefault(title, parser.add_argument_group(title))
        meta = f.metadata
        help_text = meta.get("help", "")
        if f.name == "store":
            parser.add_argument("store", nargs="?", default=argparse.SUPPRESS, metavar="STORE", help=help_text)
            continue
        typ, _ = base_type(f.name)
        if typ is bool:
            target.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
            continue
        choices = tuple(STRATEGIES) if f.name == "strategy" else meta.get("choices")
        metavar = meta.get("metavar") or ("{" + ",".join(choices) + "}" if choices else
                                          {int: "N", float: "X", dict: "JSON"}.get(typ, "VALUE"))
        # Values stay strings here: TrainConfig parses them, so the error names the flag the same way for
        # flags, --set and config files.
        target.add_argument(flag(f.name), default=argparse.SUPPRESS, metavar=metavar, help=help_text)
    parser.add_argument("--config", dest="_config_file", metavar="FILE", default=None,
                        help="read options from a JSON or TOML file (e.g. a run's config.json); flags override it")
    parser.add_argument("--set", dest="_overrides", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                        help="override options as KEY=VALUE (field names as in config.json), applied last")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Layer defaults, ``--config``, flags and ``--set`` into a validated :class:`TrainConfig`."""
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    sets: dict[str, Any] = {}
    for item in args._overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TrellisUserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=0.005")
        sets[key.strip()] = value
    check_keys(sets, "--set")
    sets = {k.replace("-", "_"): v for k, v in sets.items()}
    given = {**flags, **sets}
    resume = given.get("resume")
    if resume:
        from trellis.train.runs import open_run_dir, read_json

        if args._config_file:
            raise TrellisUserError("--config cannot be combined with --resume: a resumed run keeps its saved config")
        changed = sorted(k for k in given if k not in RESUME_ALLOWED)
        if changed:
            raise TrellisUserError(
                f"{flag(changed[0])} cannot change when resuming: --resume continues the run with the config "
                f"saved in {resume}/config.json (start a new run with --config {resume}/config.json instead)")
        paths = open_run_dir(resume, resume=True)
        saved = read_json(paths.config)
        if not isinstance(saved, dict) or not saved.get("store"):
            raise TrellisUserError(f"{paths.config}: not a run's config (a JSON object naming its store); the run "
                                   "directory is damaged: start a new run")
        check_registered(str(saved.get("model")), str(resume))  # a user's model: resumed from Python, not here
        return TrainConfig.from_dict({**saved, **given}, source=f"{resume}/config.json")
    values: dict[str, Any] = {}
    if args._config_file:
        values = load_config_file(args._config_file)
        check_keys(values, f"--config {args._config_file}")
        values = {k.replace("-", "_"): v for k, v in values.items()}
    return TrainConfig.from_dict({**values, **given}, source="trellis train")


#: The share of an epoch spent waiting for batches above which the summary suggests ``--samplers`` (on an H200 the
#: loader's own thread kept the trainer waiting 38% of a 1M-graph epoch; 8 sampler processes made it 2.96x faster).
STARVED_SHARE = 0.25


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable lines for a summary."""
    m = s["metric"]
    seeds = s["seeds"]
    test = (f"test {m} {s[f'test_{m}_mean']:.4f} (one run, seed {seeds[0]})" if len(seeds) == 1 else
            f"test {m} {s[f'test_{m}_mean']:.4f} ± {s[f'test_{m}_std']:.4f} over {len(seeds)} runs "
            f"(seeds {seeds[0]}..{seeds[-1]})")
    lines = [
        f"{test}; val {m} {s[f'val_{m}_mean']:.4f}",
        f"training step {s['epoch_time_s_median'] * 1000:.1f} ms (median of {s['steps_timed']}); "
        f"peak RSS {s['peak_rss_mb']:.0f} MiB, anonymous {s['peak_rss_anon_mb']:.0f} MiB"
        + (f", CUDA {s['peak_cuda_mb']:.0f} MiB" if "peak_cuda_mb" in s else "") + f" on {s['device']}",
        f"run directory: {s['run_dir']}",
    ]
    if s.get("undefined_val_metric"):
        lines.append(f"note: validation {m} is undefined (NaN; e.g. the val split holds one class), so the best epoch "
                     "was chosen by validation loss; --metric acc or f1 is defined there")
    if s.get("still_improving"):
        runs = s["still_improving"]
        best = [s["best_epoch"][i] + 1 for i in runs]
        lines.append(f"note: {'run' if len(runs) == 1 else 'runs'} {', '.join(map(str, runs))} still improving at the "
                     f"end (best epoch {', '.join(map(str, best))} of {s['config']['epochs']}); more --epochs may help")
    cfg = s.get("config", {})
    wait = s.get("batch_wait_share")
    if (wait is not None and wait >= STARVED_SHARE and not cfg.get("samplers") and not cfg.get("sampler_ranks")
            and s.get("threads", 1) >= 4):
        lines.append(f"note: training waited for batches {wait:.0%} of each epoch; --samplers K builds them in K "
                     "processes beside the trainer (docs/minibatch.md)")
    return "\n".join(lines)


def run_train(args: argparse.Namespace) -> int:
    """Train (or with ``--explain`` only describe) the configured runs; returns 0, or 128 + signal when interrupted."""
    from trellis.train.launch import import_user_model
    from trellis.train.trainer import Trainer, TrainingInterrupted

    import_user_model()  # a rank started for a Python caller's own model (before its config names it)
    cfg = config_from_args(args)
    rank = None
    if (cfg.parts_dir is not None and cfg.strategy in ("full", "mini", "cluster")) or cfg.strategy == "pp":
        from trellis.distributed.comm import RankEnv

        env = RankEnv.from_environ()
        if cfg.explain and cfg.strategy == "full":
            from trellis.train.strategies.partitioned import explain_distributed

            text = explain_distributed(cfg, getattr(args, "model_factory", None))
            print(text)
            if cfg.json:
                print(json.dumps({"explain": text}))
            return 0
        from trellis.train.launch import launch, needs_launch

        if needs_launch(cfg) and not cfg.explain:  # --explain describes the ranks from here, starting none
            return launch(cfg)
        if env is not None and cfg.sampler_ranks and env.rank >= env.world_size - cfg.sampler_ranks:
            from trellis.train.strategies.dist_mini import serve_batches

            return serve_batches(cfg, env)  # a sampler rank: it builds batches and trains nothing
        if env is not None:
            rank = env.rank
            if env.restart_count and cfg.resume is None and cfg.out and Path(cfg.out, "config.json").is_file():
                cfg.resume = cfg.out  # a job torchrun restarted continues from its checkpoint
    from trellis.train.launch import QUIET_ENV

    trainer = Trainer(cfg, model_factory=getattr(args, "model_factory", None),
                      quiet=os.environ.get(QUIET_ENV) == "1")  # a rank a library call started
    if cfg.explain:
        text = trainer.explain()
        print(text)
        if cfg.json:
            print(json.dumps({"explain": text}))
        return 0
    try:
        summary = trainer.fit()
    except RuntimeError as exc:
        if rank is None or os.environ.get("TRELLIS_TRACEBACK"):
            raise
        # a peer died or timed out: one line per rank (the launcher names the rank that died), none when the
        # peer refused bad input, which the launcher says
        refusals = os.environ.get(REFUSAL_DIR_ENV)
        if not (refusals and launcher_refusal(refusals)):
            print(f"rank {rank} stopped: {str(exc).strip().splitlines()[0][:300]}", file=sys.stderr)
        return 1
    except TrainingInterrupted as exc:
        if rank:  # a distributed run's peers: rank 0 says where the checkpoint is
            return 128 + int(exc.signum)
        print(f"stopped at run {exc.run}, epoch {exc.epoch}; checkpoint written. Continue with:\n"
              f"  trellis train --resume {exc.run_dir}", file=sys.stderr)
        return 128 + int(exc.signum)
    if rank:  # a distributed run's peers: rank 0 reports
        return 0
    print(format_summary(summary), file=sys.stderr if cfg.json else sys.stdout)
    if cfg.json:
        sys.stdout.flush()
        print(json.dumps(summary, default=str))
    return 0


def run_predict(args: argparse.Namespace) -> int:
    """Write predictions and embeddings of a trained run and report where they went; returns exit code 0."""
    from trellis.train.predict import predict

    info = predict(args.run_dir, args.store, args.out, run=args.run, proba=args.proba, device=args.device,
                   model_factory=getattr(args, "model_factory", None), memory_budget=args.memory_budget,
                   spill_dir=args.spill_dir, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(info))
    else:
        print(f"wrote {info['kind'].replace('_', ' ')} of {info['num_nodes']} nodes to {info['predictions']} and "
              f"{info['embedding_source']} embeddings ({info['embedding_dim']} wide) to {info['embeddings']} "
              f"(run {info['run']})")
    return 0


_nonneg_int = int_at_least(0, "expected a run number, got {text!r}", "expected a run number >= 0, got {value}")


def register(subparsers: Any) -> None:
    """Add ``train`` and ``predict`` to the ``trellis`` command."""
    p = subparsers.add_parser(
        "train", help=help_of("train"),
        description="Train a GNN on a graph store. Writes RUN_DIR/{config.json, metrics.jsonl, summary.json, "
                    "checkpoints/, models/, curves.svg}. SIGINT/SIGTERM write a checkpoint; --resume continues.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.set_defaults(func=run_train)

    q = subparsers.add_parser(
        "predict", help=help_of("predict"),
        description="Rebuild the model of RUN_DIR (its best-validation run unless --run) and write predictions "
                    "(class ids; 0/1 labels for binary; a 0/1 matrix for multilabel) or --proba probabilities to "
                    "FILE and node embeddings to FILE_emb.npy. Row i is the store's node i (a store imported "
                    "with --lcc renumbers: its node_ids.npy holds each row's id in the input).")
    q.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `trellis train`")
    q.add_argument("store", metavar="STORE", nargs="?", default=None,
                   help="graph store to predict on (same feature width; default: the store the run trained on)")
    q.add_argument("--out", required=True, metavar="FILE.npy", help="predictions file; must end in .npy")
    q.add_argument("--run", type=_nonneg_int, default=None, metavar="R",
                   help="use run R's weights (default: the best validation run; of a run directory whose "
                        "runs have not all finished, the last finished run, as the JSON's run field says)")
    q.add_argument("--proba", action="store_true",
                   help="write probabilities instead: [N, C] softmax (multiclass), [N] of the positive class "
                        "(binary), [N, C] per label (multilabel)")
    q.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}", help="(default: auto)")
    q.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="cap on peak memory (RssAnon): tiled inference with spill files (default: the run's own "
                        "--memory-budget when it trained full-batch under one, else in memory)")
    q.add_argument("--spill-dir", default=None, metavar="DIR",
                   help="with a memory budget: where spill files go (default: the run's, else RUN_DIR/spill)")
    q.add_argument("--overwrite", action="store_true", help="replace existing FILE and FILE_emb.npy")
    q.add_argument("--json", action="store_true", help="print what was written as one JSON line")
    q.set_defaults(func=run_predict)
