"""Classification metrics on whole tensors: ROC-AUC, F1 (binary, micro, macro) and accuracy.

Why here and not scikit-learn: metrics run every epoch on every split, on the training device, inside
the trainer loop; a round trip to NumPy and scikit-learn per split and epoch would copy logits off the
GPU and add a heavy runtime dependency. These functions are vectorized torch (sorts, cumulative
maxima, bincounts; no Python loop over nodes or labels) and reproduce scikit-learn's definitions,
which the tests check to 1e-6 (scikit-learn is a dev dependency only):

- :func:`roc_auc` / :func:`roc_auc_columns` equal ``sklearn.metrics.roc_auc_score``: the
  Mann-Whitney statistic with tied scores given their average rank (a tie between a positive and a
  negative counts one half).
- :func:`f1_binary`, :func:`f1_micro`, :func:`f1_macro_multilabel` and :func:`f1_macro_multiclass`
  equal ``sklearn.metrics.f1_score`` with ``average="binary" | "micro" | "macro"`` and the default
  ``zero_division`` (an F1 of 0/0 counts as 0).

All results are Python floats computed in float64; a split with no rows gives NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "accuracy",
    "average_ranks",
    "exact_match",
    "f1_binary",
    "f1_macro_multiclass",
    "f1_macro_multilabel",
    "f1_micro",
    "roc_auc",
    "roc_auc_columns",
    "roc_auc_macro",
]

_NAN = float("nan")


def _f1(tp: Tensor, fp: Tensor, fn: Tensor) -> Tensor:
    """``2 tp / (2 tp + fp + fn)`` elementwise, 0 where the denominator is 0 (scikit-learn's default)."""
    denom = 2 * tp + fp + fn
    return torch.where(denom > 0, 2 * tp / denom.clamp(min=1), torch.zeros_like(denom))


def average_ranks(scores: Tensor) -> tuple[Tensor, Tensor]:
    """1-based ranks of each column of ``scores [N, C]`` with ties given their average rank.

    Why not a loop over tie groups: after one sort per column, the first position of a tie group is a
    running maximum of "group starts here" positions and the last position a reversed running minimum,
    so the average rank ``(first + last) / 2 + 1`` of every element comes from two cumulative scans.

    Args:
        scores: ``[N, C]`` scores (any real dtype).

    Returns:
        ``(ranks, order)``: ``ranks [N, C]`` float64 average ranks in sorted order (row ``i`` of column
        ``c`` is the rank of ``scores[order[i, c], c]``) and ``order [N, C]``, the sorting permutation.
    """
    n = scores.shape[0]
    sorted_scores, order = torch.sort(scores, dim=0, stable=True)
    pos = torch.arange(n, device=scores.device).unsqueeze(1).expand_as(sorted_scores)
    starts = torch.ones_like(sorted_scores, dtype=torch.bool)
    starts[1:] = sorted_scores[1:] != sorted_scores[:-1]
    ends = torch.ones_like(starts)
    ends[:-1] = starts[1:]
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=0).values
    last = torch.where(ends, pos, torch.full_like(pos, n)).flip(0).cummin(dim=0).values.flip(0)
    ranks = (first + last).to(torch.float64) / 2 + 1
    return ranks, order


def roc_auc_columns(scores: Tensor, y: Tensor) -> Tensor:
    """ROC-AUC of every column of ``scores [N, C]`` against 0/1 targets ``y [N, C]``.

    The area equals the probability that a random positive scores above a random negative (ties count
    one half), computed from average ranks: ``(R_pos - P (P + 1) / 2) / (P * Q)`` with ``R_pos`` the rank
    sum of the ``P`` positives and ``Q`` negatives. O(N log N) per column, all columns in one sort.

    Args:
        scores: ``[N, C]`` real scores (logits or probabilities; only their order matters).
        y: ``[N, C]`` targets, nonzero = positive.

    Returns:
        ``[C]`` float64 areas; NaN for a column whose targets are all one class (AUC is undefined).
    """
    if scores.ndim == 1:
        scores, y = scores.unsqueeze(1), y.unsqueeze(1)
    if scores.shape[0] == 0:
        return torch.full((scores.shape[1],), _NAN, dtype=torch.float64, device=scores.device)
    ranks, order = average_ranks(scores)
    pos_sorted = torch.gather(y != 0, 0, order).to(torch.float64)
    p = pos_sorted.sum(dim=0)
    q = scores.shape[0] - p
    r_pos = (ranks * pos_sorted).sum(dim=0)
    auc = (r_pos - p * (p + 1) / 2) / (p * q).clamp(min=1)
    return torch.where((p > 0) & (q > 0), auc, torch.full_like(auc, _NAN))


def roc_auc(scores: Tensor, y: Tensor) -> float:
    """Binary ROC-AUC of ``scores [N]`` against 0/1 targets ``y [N]``; NaN when ``y`` has one class."""
    return float(roc_auc_columns(scores.reshape(-1, 1), y.reshape(-1, 1))[0])


def roc_auc_macro(scores: Tensor, y: Tensor) -> float:
    """Unweighted mean of the per-label ROC-AUCs of ``[N, C]`` scores and targets.

    Labels whose targets in this split are all 0 or all 1 are skipped (their AUC is undefined; scikit-learn
    raises instead). NaN when no label has both classes.
    """
    auc = roc_auc_columns(scores, y)
    valid = ~torch.isnan(auc)
    return float(auc[valid].mean()) if bool(valid.any()) else _NAN


def _counts(pred: Tensor, y: Tensor, dim: int | None) -> tuple[Tensor, Tensor, Tensor]:
    p, t = pred != 0, y != 0

    def count(mask: Tensor) -> Tensor:
        return (mask.sum() if dim is None else mask.sum(dim=dim)).to(torch.float64)

    return count(p & t), count(p & ~t), count(~p & t)


def f1_binary(pred: Tensor, y: Tensor) -> float:
    """F1 of the positive class for 0/1 predictions and targets ``[N]`` (0 when nothing is positive)."""
    if y.numel() == 0:
        return _NAN
    return float(_f1(*_counts(pred, y, None)))


def f1_micro(pred: Tensor, y: Tensor) -> float:
    """Micro F1 of 0/1 ``[N, C]`` predictions: true/false positives and negatives pooled over all labels."""
    if y.numel() == 0:
        return _NAN
    return float(_f1(*_counts(pred, y, None)))


def f1_macro_multilabel(pred: Tensor, y: Tensor) -> float:
    """Unweighted mean over all ``C`` labels of each label's F1 (0/1 ``[N, C]``).

    As scikit-learn, every label counts, and a label with no true and no predicted positive in the
    split scores 0.
    """
    if y.shape[0] == 0:
        return _NAN
    return float(_f1(*_counts(pred, y, 0)).mean())


def f1_macro_multiclass(pred: Tensor, y: Tensor, num_classes: int) -> float:
    """Unweighted mean F1 over the classes that occur in ``y`` or in ``pred`` (class ids ``[N]``).

    Classes that neither occur nor are predicted are left out (their F1 is 0/0), as scikit-learn does
    when ``labels`` is not given.
    """
    if y.numel() == 0:
        return _NAN
    correct = pred == y
    tp = torch.bincount(y[correct], minlength=num_classes).to(torch.float64)
    pred_count = torch.bincount(pred, minlength=num_classes).to(torch.float64)
    true_count = torch.bincount(y, minlength=num_classes).to(torch.float64)
    f1 = _f1(tp, pred_count - tp, true_count - tp)
    return float(f1[(pred_count + true_count) > 0].mean())


def accuracy(pred: Tensor, y: Tensor) -> float:
    """Fraction of rows whose prediction equals the target (``[N]`` class ids or 0/1 labels)."""
    if y.numel() == 0:
        return _NAN
    return float((pred == y).to(torch.float64).mean())


def exact_match(pred: Tensor, y: Tensor) -> float:
    """Subset accuracy of ``[N, C]`` 0/1 rows: the fraction whose every label is right.

    This is what ``sklearn.metrics.accuracy_score`` returns for multilabel input.
    """
    if y.shape[0] == 0:
        return _NAN
    return float(((pred != 0) == (y != 0)).all(dim=1).to(torch.float64).mean())
