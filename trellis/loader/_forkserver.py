"""Imported by the sampler workers' fork server only (its preload, :mod:`trellis.loader.producer`).

Why: ``timeout``, Slurm and systemd stop a job by sending SIGTERM to its whole process group, which holds the
fork server that :mod:`multiprocessing` starts for the sampler workers. The server died of it (it ignores only
SIGINT), and every worker it had forked then read as exited with code 255 — so the trainer's stop, which
finishes its epoch with those workers and writes a checkpoint, failed instead. The server now ignores SIGTERM
as well; it still exits when the trainer does (its pipe to the trainer closes).
"""

from __future__ import annotations

import signal
import sys

if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # only in the fork server itself
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
