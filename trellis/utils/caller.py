"""What a library call leaves of its caller's process: nothing it changed.

Why: training seeds every generator, may turn on deterministic algorithms, and (through numba's OpenMP start)
changes torch's thread count; a CLI process exits afterwards, a notebook does not. A caller's loop that draws a
random split from ``np.random`` before every ``trellis.train`` drew the same split every time, and a caller's
``torch.set_num_threads(1)`` was undone. Conversely a caller's state must not change what Trellis computes: a
``torch.no_grad()`` block or a float64 default dtype made training fail, or silently train in float64.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def caller_state_kept() -> Iterator[None]:
    """Run the body as a fresh process would, then give the caller back its global state.

    Inside: float32 default dtype, gradients on, no inference mode, and numba's threading layer started without
    undoing the caller's torch thread count (numba kernels then use as many threads as torch). Afterwards: the
    Python, NumPy, torch CPU (and initialized CUDA) generators, the torch thread count, the deterministic-algorithms
    flags and the default dtype as they were.
    """
    import torch

    from trellis.utils.numba import launch_threads

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    launch_threads()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
                != (det, det_warn):  # only when changed: setting it imports torch._dynamo (about 2 s)
            torch.use_deterministic_algorithms(det, warn_only=det_warn)


def keeps_caller_state(fn: F) -> F:
    """Decorate a public library function: it runs inside :func:`caller_state_kept`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with caller_state_kept():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
