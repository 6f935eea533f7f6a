"""Weight initialization schemes by name: ``default`` (each layer's own), ``xavier`` and ``he``.

Why a named registry here: the initialization is a hyperparameter (Dorylus §7.1 compares Xavier and He;
a sweep grid may list ``init=xavier,he``), and a sweep's configuration must equal its solo run, so both the
sweep and the trainer call :func:`init_parameters` at the same point — right after the model is built
and before it moves to its device — and draw the same random numbers.
"""

from __future__ import annotations

from torch import nn

#: Initialization schemes; ``default`` keeps what each layer's constructor drew.
INITS = ("default", "xavier", "he")


def init_parameters(model: nn.Module, scheme: str) -> nn.Module:
    """Re-initialize every weight matrix of ``model`` with ``scheme``; biases become zero.

    Weight matrices are parameters with two or more dimensions (linear maps, attention vectors),
    visited in ``named_parameters`` order so the draws are deterministic given the RNG state. ``he``
    uses Kaiming-uniform with the ReLU gain; ``xavier`` Glorot-uniform.

    Args:
        model: The model, freshly built.
        scheme: One of :data:`INITS`.

    Raises:
        ValueError: Unknown scheme.
    """
    if scheme not in INITS:
        raise ValueError(f"unknown init {scheme!r}; choose one of {', '.join(INITS)}")
    if scheme == "default":
        return model
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            if scheme == "xavier":
                nn.init.xavier_uniform_(p)
            else:
                nn.init.kaiming_uniform_(p, nonlinearity="relu")
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model
