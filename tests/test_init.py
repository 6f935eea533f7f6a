"""``import trellis``: the process settings it makes before torch starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trellis

ROOT = Path(__file__).resolve().parents[1]
SHOW = "import os, sys; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"


def _show(first: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = f"import {first}; import trellis, torch; {SHOW}"
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_asks_torch_for_huge_pages_where_the_kernel_has_them():
    assert _show("os") == ("1" if trellis._huge_pages_possible() else "None")


def test_a_users_choice_and_an_earlier_torch_are_left_alone():
    assert _show("os", THP_MEM_ALLOC_ENABLE="0") == "0"
    assert _show("torch") == "None"  # torch started first: too late to apply, so nothing is set
