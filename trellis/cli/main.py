"""The ``trellis`` command.

Each subcommand lives in its own module under ``trellis.cli`` exposing ``register(subparsers)``; this
module only wires them together and maps errors to exit codes: 0 success, 2 user error (one clear line,
no traceback), 1 internal error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from types import FrameType
from typing import Any

from trellis.cli.commands import COMMANDS
from trellis.errors import ProcessFailure, RankRefused, TrellisUserError, report_to_launcher
from trellis.utils.signals import defer_if_in_llvm


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so bad flags become exit-2 user errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise TrellisUserError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``trellis`` parser with every subcommand's full parser (``commands`` None) or only those named.

    Only the named subcommands' modules are imported; the others are listed with their one-line help
    (:data:`~trellis.cli.commands.COMMANDS`), which is all ``trellis --help`` and an unknown command's error
    show. Why: the modules import torch (about 2.5 s), which a help screen or ``trellis data info`` does not need.
    """
    parser = _Parser(prog="trellis", description="Train graph neural networks on large graphs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    wanted = {c.module for c in COMMANDS if commands is None or c.name in commands}
    for c in COMMANDS:
        if c.module in wanted:
            importlib.import_module(c.module).register(sub)  # may add several commands (train and predict)
            wanted.discard(c.module)
        elif c.name not in sub.choices:
            sub.add_parser(c.name, help=c.help)  # listed, never parsed: a named command is always registered
    parser.set_defaults(_subcommands=sub.choices)
    return parser


def _unrecognized(args: argparse.Namespace, extra: list[str]) -> TrellisUserError:
    """An unknown flag of a subcommand: named, with the closest flag that subcommand has and its help."""
    import difflib

    command = getattr(args, "command", None)
    sub = getattr(args, "_subcommands", {}).get(command)
    first = next((e for e in extra if e.startswith("-")), extra[0])
    if sub is None:
        return TrellisUserError(f"trellis: unrecognized arguments: {' '.join(extra)} (see `trellis --help`)")
    flags = [o for a in sub._actions for o in a.option_strings]
    name = first.split("=")[0]
    hint = difflib.get_close_matches(name, flags, n=1, cutoff=0.7)
    if not hint and "--set" in flags and name.startswith("--"):
        # sweep and tune take every `trellis train` option through --set (`--strategy pp` was "unrecognized")
        from trellis.train.config import SESSION_FIELDS, TrainConfig

        fields = [f for f in TrainConfig.__dataclass_fields__ if f not in SESSION_FIELDS]  # an invocation's own
        key = name[2:].replace("-", "_")
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        if key in fields or close:
            exact, key = key in fields, key if key in fields else close[0]
            at = extra.index(first)
            value = first.split("=", 1)[1] if "=" in first else \
                extra[at + 1] if at + 1 < len(extra) and not extra[at + 1].startswith("-") else "VALUE"
            said = (f"{name} is a `trellis train` option; pass it as" if exact else
                    f"unrecognized argument {name}; training options go through --set: did you mean")
            return TrellisUserError(f"trellis {command}: {said} --set {key}={value}{'' if exact else '?'} "
                                    f"(see `trellis {command} --help`)")
    return TrellisUserError(f"trellis {command}: unrecognized argument {first}"
                            + (f"; did you mean {hint[0]}?" if hint else "")
                            + f" (see `trellis {command} --help`)")


def _value_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of ``parser`` and its built subparsers, by option string."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        out.update({o: action for o in action.option_strings})
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                out.update(_value_options(sub))
    return out


def attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--fanouts -1,10`` as ``--fanouts=-1,10``: a value that starts with ``-`` given after its option.

    argparse reads any word that starts with ``-`` and is not a plain negative number as an option, so the
    documented ``--fanouts -1,10`` ("-1 = all") failed with "expected one argument". A word is attached to the
    option before it when that option takes one value and the word is not an option of the command.
    """
    options = _value_options(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        action = options.get(word)
        if (action is not None and action.nargs is None and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and len(argv[i + 1]) > 1 and not argv[i + 1].startswith("--") and argv[i + 1] not in options):
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


#: Commands that run torch and numba kernels (the rest, ``data`` and ``compare``, start without them).
COMPUTING = frozenset({"train", "predict", "sweep", "tune", "preprocess", "partition", "bench", "demo"})


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (see :func:`main`)."""


class _SignalsUnwind:
    """SIGTERM raises :class:`Terminated` (Ctrl-C ``KeyboardInterrupt``) where the command is, never inside LLVM.

    A signal inside numba's compilation is sent again once LLVM's callback has returned
    (:mod:`trellis.utils.signals`; a job cancelled in its first seconds ended in numba's "no compiled object yet",
    exit 1); and if an error still escapes after the signal, the command reports the signal.
    """

    def __init__(self) -> None:
        #: The signal that arrived (None: none yet).
        self.signum: int | None = None
        self._retry: threading.Timer | None = None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        self._retry = defer_if_in_llvm(signum, frame)
        if self._retry is None:
            self._raise()

    def _raise(self, cause: BaseException | None = None) -> None:
        raise (Terminated if self.signum == signal.SIGTERM else KeyboardInterrupt) from cause

    def run(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` with SIGTERM and SIGINT unwinding it (main thread only)."""
        previous = {s: signal.signal(s, self.handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return call()
        except Exception as exc:
            if self.signum is not None:  # the error is the signal's doing (a dropped raise)
                self._raise(exc)
            raise
        finally:
            if self._retry is not None:
                self._retry.cancel()
            for s, h in previous.items():
                signal.signal(s, h)


def main(argv: Sequence[str] | None = None, *, model_factory: Callable[..., Any] | None = None) -> int:
    """Entry point; returns the exit code (also used by tests).

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
        model_factory: Builds models by name for ``train``, ``sweep`` and ``predict`` (default:
            :func:`trellis.nn.build_model`; tests pass a small stub model).
    """
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        named = argv[:1] if argv and not argv[0].startswith("-") else []  # the subcommand: its first word
        parser = build_parser(named)
        args, extra = parser.parse_known_args(attach_dash_values(parser, argv))
        if extra:
            raise _unrecognized(args, extra)
        args.model_factory = model_factory
        if args.command in COMPUTING:
            from trellis.utils.numba import launch_threads

            launch_threads()  # before numba's first kernel could undo OMP_NUM_THREADS (or torch's default)
        if args.command != "train" and threading.current_thread() is threading.main_thread():
            # a SIGTERM (a job cancelled) unwinds like Ctrl-C, so what a command was writing is removed (a sweep's
            # hidden directory and its spills stayed), never inside LLVM (_SignalsUnwind); `train` checkpoints itself
            return int(_SignalsUnwind().run(lambda: args.func(args)) or 0)
        rc = args.func(args)
        return int(rc or 0)
    except RankRefused:  # another rank of the job printed why
        return 2
    except TrellisUserError as exc:
        if not report_to_launcher(exc):  # a launched rank's launcher says it, once
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except ProcessFailure as exc:
        if os.environ.get("TRELLIS_TRACEBACK"):
            raise
        print(f"error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): not a path's fault
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's exit flushes it
        print("error: the command's output pipe was closed by its reader (e.g. `| head`); the command stopped",
              file=sys.stderr)
        return 1
    except OSError as exc:
        # The file system refused a path or ran out of space (an unwritable --out, a missing parent, a full disk):
        # one line naming the path, as for any bad input; TRELLIS_TRACEBACK=1 shows where.
        short = exc.errno is None and re.search(r"\d+ requested and \d+ written", str(exc))
        if short:  # numpy's short write (ndarray.tofile): the file system filled up, without an errno
            print(f"error: a write stopped short ({exc}): the file system is full; free space or choose another "
                  "--out", file=sys.stderr)
            return 2
        if os.environ.get("TRELLIS_TRACEBACK") or exc.errno is None:
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc} (check the path, its permissions and the free space)",
              file=sys.stderr)
        return 2


def entry() -> None:
    """Console-script entry point: run :func:`main` on ``sys.argv`` and exit with its code."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
