"""The one numba capability flag of the package, and the decorators every kernel module uses.

Why one flag: numba is a declared dependency, but a kernel module must stay importable (and correct)
without it, and ``TRELLIS_DISABLE_NUMBA=1`` must switch every kernel to its pure path at once (tests
compare the two; a user with a broken numba install needs a way out). Before this module, three flags
answered the question three ways. Every module now imports :data:`WITH_NUMBA`, :func:`njit` and
:data:`prange` from here: modules with a vectorized fallback branch on the flag, modules without one
(partitioners, samplers) run their kernels as plain Python when it is off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["WITH_NUMBA", "get_num_threads", "launch_threads", "njit", "prange", "set_num_threads", "set_threads"]


def _disabled() -> bool:
    return os.environ.get("TRELLIS_DISABLE_NUMBA", "0") not in ("", "0")


def _identity_njit(*args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``numba.njit``: returns the function unchanged (both ``@njit`` and ``@njit(...)``)."""
    if args and callable(args[0]):
        return args[0]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    return wrap


njit: Callable[..., Any]
prange: Callable[..., Any]
try:  # pragma: no cover - which branch runs depends on the environment, not on a test
    if _disabled():
        raise ImportError("disabled by TRELLIS_DISABLE_NUMBA")
    from numba import njit as _numba_njit
    from numba import prange as _numba_prange

    #: Whether numba kernels are compiled and used (numba importable and ``TRELLIS_DISABLE_NUMBA`` unset).
    WITH_NUMBA = True
    njit = _numba_njit
    prange = _numba_prange
except ImportError:  # pragma: no cover
    WITH_NUMBA = False
    njit = _identity_njit
    prange = range


def get_num_threads() -> int:
    """Threads numba kernels launched from this thread use (1 when numba is off)."""
    if not WITH_NUMBA:
        return 1
    import numba

    return int(numba.get_num_threads())


def max_threads() -> int:
    """The most threads numba kernels may use in this process (``NUMBA_NUM_THREADS``; 1 when numba is off)."""
    if not WITH_NUMBA:
        return 1
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


def set_num_threads(n: int) -> None:
    """Set the calling thread's numba thread count (a no-op when numba is off)."""
    if WITH_NUMBA:
        import numba

        numba.set_num_threads(n)


def launch_threads() -> None:
    """Start numba's threading layer now, keeping this thread's torch thread count (once per process).

    Why: numba starts its OpenMP layer lazily, at its first parallel kernel or thread call, and the start sets
    the calling thread's OpenMP thread count, which torch shares (the same ``libgomp``), to
    ``NUMBA_NUM_THREADS`` (every core). A ``torch.set_num_threads`` made before that start was silently
    undone: sampler processes set to one thread ran torch on all 16 cores of a 16-core machine (5.6 cores busy
    per process, 115 ms of CPU per batch against 13.5 ms on one thread). The calling thread's numba kernels then
    use as many threads as torch (within numba's pool): a caller's ``torch.set_num_threads(1)`` or
    ``OMP_NUM_THREADS=1`` holds for both.
    """
    if not WITH_NUMBA:
        return
    import numba
    import torch

    keep = torch.get_num_threads()
    numba.get_num_threads()  # starts the layer (a no-op once started)
    torch.set_num_threads(keep)
    numba.set_num_threads(max(1, min(keep, max_threads())))


def set_threads(torch_threads: int, numba_threads: int | None = None) -> None:
    """This thread's torch threads and numba kernel threads (default: as many as torch's, within numba's pool).

    numba's layer is started first (:func:`launch_threads`), so that its start cannot undo torch's count.
    """
    import torch

    launch_threads()
    torch.set_num_threads(max(1, int(torch_threads)))
    n = torch_threads if numba_threads is None else numba_threads
    set_num_threads(max(1, min(int(n), max_threads())))
