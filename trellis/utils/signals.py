"""Signal handlers that raise: never inside LLVM's callbacks, where the exception would be lost.

numba compiles a kernel the first time it runs, and LLVM calls back into Python (a ctypes callback) to store the
compiled object in numba's cache. An exception a signal handler raises there is printed ("Exception ignored on
calling ctypes callback function") and dropped, and numba then fails with "no compiled object yet": a job
cancelled in its first seconds ended in a traceback instead of unwinding. A handler that would raise in such a
frame sends the signal again a moment later instead, once the callback has returned (from a thread's timer:
SIGALRM belongs to pytest-timeout and to callers).
"""

from __future__ import annotations

import os
import threading
from types import FrameType

#: How long until a deferred signal is sent again (seconds).
RETRY_S = 0.05


def in_llvm_callback(frame: FrameType | None) -> bool:
    """Whether the interrupted frame is llvmlite's Python code (an LLVM callback: a raise there is dropped)."""
    return frame is not None and f"{os.sep}llvmlite{os.sep}" in frame.f_code.co_filename


def defer_if_in_llvm(signum: int, frame: FrameType | None) -> threading.Timer | None:
    """Send ``signum`` to this process again in :data:`RETRY_S` if ``frame`` is an LLVM callback.

    Returns:
        The started timer (cancel it when the handler's scope ends), or None: the handler may raise now.
    """
    if not in_llvm_callback(frame):
        return None
    timer = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()
    return timer
