"""trellis.train.metrics against scikit-learn (a dev dependency) on random inputs, ties included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.train import metrics as M

sk = pytest.importorskip("sklearn.metrics")

TOL = 1e-6


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@st.composite
def scored_labels(draw, min_cols: int = 1, max_cols: int = 6):
    """Random ``(scores [N, C], y [N, C])``; scores drawn from few levels half of the time (many ties)."""
    n = draw(st.integers(2, 80))
    c = draw(st.integers(min_cols, max_cols))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        scores = rng.integers(0, draw(st.integers(1, 4)), (n, c)).astype(np.float64)
    else:
        scores = rng.normal(size=(n, c))
    y = (rng.random((n, c)) < draw(st.floats(0.05, 0.95))).astype(np.int64)
    return scores, y


@settings(max_examples=150, deadline=None)
@given(scored_labels())
def test_roc_auc_columns_match_sklearn(data):
    scores, y = data
    ours = M.roc_auc_columns(_t(scores), _t(y)).numpy()
    for j in range(y.shape[1]):
        if np.unique(y[:, j]).size == 2:
            assert abs(ours[j] - sk.roc_auc_score(y[:, j], scores[:, j])) < TOL
        else:
            assert math.isnan(ours[j])


@settings(max_examples=100, deadline=None)
@given(scored_labels(min_cols=2))
def test_roc_auc_macro_matches_sklearn_over_two_class_labels(data):
    scores, y = data
    keep = np.array([np.unique(y[:, j]).size == 2 for j in range(y.shape[1])])
    ours = M.roc_auc_macro(_t(scores), _t(y))
    if keep.sum() >= 2:
        assert abs(ours - sk.roc_auc_score(y[:, keep], scores[:, keep], average="macro")) < TOL
    elif keep.sum() == 1:
        assert abs(ours - sk.roc_auc_score(y[:, keep][:, 0], scores[:, keep][:, 0])) < TOL
    else:
        assert math.isnan(ours)


def test_binary_auc_float32_logits_and_ties():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 5000)
    logits = (rng.normal(size=5000) + y).astype(np.float32)
    logits[::7] = 0.25  # a large tie group spanning both classes
    assert abs(M.roc_auc(_t(logits), _t(y)) - sk.roc_auc_score(y, logits)) < TOL
    assert M.roc_auc(_t(np.zeros(4)), _t(np.array([0, 1, 0, 1]))) == 0.5  # all tied
    assert math.isnan(M.roc_auc(_t(np.ones(3)), _t(np.ones(3))))  # one class: undefined
    assert math.isnan(M.roc_auc(_t(np.zeros(0)), _t(np.zeros(0))))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 80), st.integers(2, 6), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_f1_and_accuracy_match_sklearn(n, c, seed, density):
    rng = np.random.default_rng(seed)
    y = (rng.random((n, c)) < density).astype(np.int64)
    pred = (rng.random((n, c)) < density).astype(np.int64)
    kw = {"zero_division": 0}
    assert abs(M.f1_micro(_t(pred), _t(y)) - sk.f1_score(y, pred, average="micro", **kw)) < TOL
    assert abs(M.f1_macro_multilabel(_t(pred), _t(y)) - sk.f1_score(y, pred, average="macro", **kw)) < TOL
    assert abs(M.exact_match(_t(pred), _t(y)) - sk.accuracy_score(y, pred)) < TOL
    yb, pb = y[:, 0], pred[:, 0]
    assert abs(M.f1_binary(_t(pb), _t(yb)) - sk.f1_score(yb, pb, **kw)) < TOL
    assert abs(M.accuracy(_t(pb), _t(yb)) - sk.accuracy_score(yb, pb)) < TOL
    yc, pc = rng.integers(0, c, n), rng.integers(0, c, n)  # some classes absent from y or pred
    assert abs(M.f1_macro_multiclass(_t(pc), _t(yc), c) - sk.f1_score(yc, pc, average="macro", **kw)) < TOL


def test_empty_split_is_nan():
    e1, e2 = torch.zeros(0, dtype=torch.int64), torch.zeros((0, 3), dtype=torch.int64)
    for value in (M.f1_binary(e1, e1), M.accuracy(e1, e1), M.f1_macro_multiclass(e1, e1, 3), M.f1_micro(e2, e2),
                  M.f1_macro_multilabel(e2, e2), M.exact_match(e2, e2), M.roc_auc_macro(e2.double(), e2)):
        assert math.isnan(value)


def test_average_ranks_ties():
    ranks, order = M.average_ranks(torch.tensor([[3.0], [1.0], [3.0], [2.0], [3.0]]))
    assert order[:, 0].tolist() == [1, 3, 0, 2, 4]
    assert ranks[:, 0].tolist() == [1.0, 2.0, 4.0, 4.0, 4.0]
