"""Signal handlers never raise inside LLVM's callbacks, where the exception would be dropped."""

from __future__ import annotations

import ctypes
import importlib.util
import io
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trellis.utils.signals import defer_if_in_llvm, in_llvm_callback


def llvm_callback(tmp_path: Path, body: str) -> Any:
    """A ctypes callback whose code lives under an ``llvmlite`` folder, as LLVM's cache callback does."""
    folder = tmp_path / "llvmlite"
    folder.mkdir(exist_ok=True)
    path = folder / f"fake_callback_{len(list(folder.iterdir()))}.py"
    path.write_text(f"import os, signal, time\n\ndef notify():\n{body}\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return ctypes.CFUNCTYPE(None)(module.notify)


def busy(seconds: float) -> str:
    """A callback body that keeps the interpreter in the callback for ``seconds``."""
    return f"    end = time.monotonic() + {seconds}\n    while time.monotonic() < end:\n        pass"


def test_only_llvmlites_frames_defer(tmp_path):
    frames = []
    callback = llvm_callback(tmp_path, "    import sys\n    sys._frames.append(sys._getframe())")
    sys._frames = frames  # type: ignore[attr-defined]
    try:
        callback()
    finally:
        del sys._frames  # type: ignore[attr-defined]
    assert in_llvm_callback(frames[0]) and not in_llvm_callback(sys._getframe()) and not in_llvm_callback(None)
    assert defer_if_in_llvm(signal.SIGINT, sys._getframe()) is None
    timer = defer_if_in_llvm(signal.SIGUSR1, frames[0])
    assert timer is not None
    timer.cancel()


def test_a_second_ctrl_c_inside_llvm_still_aborts_training(tmp_path):
    """StopOnSignal's second Ctrl-C (abort without a checkpoint) raised inside LLVM's callback was dropped."""
    import os

    from trellis.train.loop import StopOnSignal

    callback = llvm_callback(tmp_path, "    os.kill(os.getpid(), signal.SIGINT)\n" + busy(0.2))
    ran_on = []
    with pytest.raises(KeyboardInterrupt), StopOnSignal(io.StringIO()) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # the first: a checkpoint after this epoch
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT
        callback()  # the second, while numba compiles
        end = time.monotonic() + 5
        while time.monotonic() < end:
            time.sleep(0.01)
        ran_on.append(True)
    assert not ran_on
