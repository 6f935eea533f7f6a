from __future__ import annotations

import numpy as np
import pytest

from trellis.data.splits import per_class_split, random_split
from trellis.errors import TrellisUserError


def test_per_class_split():
    y = np.array([0] * 60 + [1] * 30 + [2] * 10 + [-1] * 5)
    s = per_class_split(y, 20, 30, seed=0)
    assert np.bincount(y[s["train"]], minlength=3).tolist() == [20, 20, 10]
    assert np.bincount(y[s["val"]], minlength=3).tolist() == [30, 10, 0]
    assert np.bincount(y[s["test"]], minlength=3).tolist() == [10, 0, 0]
    every = np.concatenate(list(s.values()))
    assert np.unique(every).size == every.size == 100  # disjoint, unlabelled nodes excluded
    assert all(np.all(np.diff(v) > 0) for v in s.values())
    again = per_class_split(y, 20, 30, seed=0)
    assert all(np.array_equal(s[k], again[k]) for k in s)
    assert not np.array_equal(s["train"], per_class_split(y, 20, 30, seed=1)["train"])


def test_random_split():
    s = random_split(1000, 0.1, 0.2, seed=0)
    assert [v.size for v in s.values()] == [100, 200, 700]
    assert np.unique(np.concatenate(list(s.values()))).size == 1000
    with pytest.raises(TrellisUserError, match="split fractions"):
        random_split(10, 0.8, 0.5)
