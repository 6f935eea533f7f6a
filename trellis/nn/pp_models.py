"""Pre-propagation models: SGC, SIGN and HOGA over a hop stack ``[B, H, F]`` (PP-GNN §2.5).

The graph was consumed by preprocessing (``trellis preprocess``), so these are dense models: their input
is the hop stack of a batch of nodes — ``x[:, k]`` are the features after hop ``hops_used(R)[k]`` — and
they never see a graph. That is why they live beside, not inside, the message-passing registry.

* :class:`SGC` — one linear layer on ``B^R X`` (Wu et al. 2019); it reads a single hop.
* :class:`SIGN` — a linear map per hop, concatenated, then an MLP (Frasca et al. 2020). The per-hop maps
  run as one batched matmul over the hop-major layout the loaders produce.
* :class:`HOGA` — hop features as ``R+1`` tokens (with a learned hop embedding), one transformer
  block of multi-head self-attention across hops, attention-pooled readout, then an MLP (Deng et al.
  2024, "hop-wise graph attention").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from trellis.errors import TrellisUserError


def _mlp(in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float,
         batch_norm: bool = False) -> nn.Sequential:
    """``layers`` linear layers with (BatchNorm,) ReLU and dropout between them (``layers=1``: one linear map)."""
    mods: list[nn.Module] = []
    d = in_dim
    for _ in range(layers - 1):
        mods += [nn.Linear(d, hidden), *([nn.BatchNorm1d(hidden)] if batch_norm else []), nn.ReLU(),
                 nn.Dropout(dropout)]
        d = hidden
    mods.append(nn.Linear(d, out_dim))
    return nn.Sequential(*mods)


class PPModel(nn.Module):
    """Base class: a model over hop stacks; :meth:`hops_used` says which hops its input holds."""

    name = ""

    @staticmethod
    def hops_used(num_hops: int) -> tuple[int, ...]:
        """The hops (of ``0..R``) whose features the model reads, in input order."""
        return tuple(range(num_hops + 1))


class SGC(PPModel):
    """Simplified graph convolution: ``softmax(B^R X W)`` — logistic regression on the last hop.

    Args:
        in_dim: Feature width ``F``.
        out_dim: Number of outputs (classes).
        dropout: Dropout on the input (default: 0).
    """

    name = "sgc"

    def __init__(self, in_dim: int, out_dim: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.lin = nn.Linear(in_dim, out_dim)

    @staticmethod
    def hops_used(num_hops: int) -> tuple[int, ...]:
        """Only the last hop ``R``: SGC is a linear model on ``S^R X``."""
        return (num_hops,)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[B, H, F]`` (the last hop slot is used) → ``[B, out_dim]``."""
        return self.lin(self.dropout(x[:, -1]))


class SIGN(PPModel):
    """Scalable inception graph network: per-hop linear maps, concatenation, MLP.

    With ``batch_norm`` (the default, as in SIGN's reference ``FeedForwardNet``) each hop's map and each
    hidden MLP layer is batch-normalized. Why: raw bag-of-words features with hundreds of active entries
    (Amazon Computers) give pre-activations large enough that Adam at lr 0.01 kills the PReLU units and
    training stalls at chance; normalized, the same settings train.

    Args:
        in_dim: Feature width ``F``.
        num_hops: ``R`` (the input holds ``R+1`` hops).
        out_dim: Number of outputs.
        hidden: Width of each hop's map and of the MLP (default: 256).
        layers: Linear layers of the MLP after concatenation (default: 2).
        dropout: Dropout after the hop maps and inside the MLP (default: 0.5).
        input_dropout: Dropout on the input features (default: 0).
        batch_norm: Batch-normalize hop maps and hidden layers (default: True).
    """

    name = "sign"

    def __init__(self, in_dim: int, num_hops: int, out_dim: int, *, hidden: int = 256, layers: int = 2,
                 dropout: float = 0.5, input_dropout: float = 0.0, batch_norm: bool = True) -> None:
        super().__init__()
        h = num_hops + 1
        self.num_slots = h
        self.weight = nn.Parameter(torch.empty(h, in_dim, hidden))
        self.bias = nn.Parameter(torch.zeros(h, 1, hidden))
        bound = 1.0 / math.sqrt(in_dim)
        nn.init.uniform_(self.weight, -bound, bound)  # nn.Linear's default init, per hop
        self.input_dropout = nn.Dropout(input_dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(h * hidden) if batch_norm else nn.Identity()  # per hop and channel
        self.act = nn.PReLU()
        self.mlp = _mlp(h * hidden, hidden, out_dim, layers, dropout, batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[B, R+1, F]`` (any strides; hop-major views avoid a copy) → ``[B, out_dim]``."""
        b = x.shape[0]
        xh = self.input_dropout(x.transpose(0, 1))  # [H, B, F]
        z = torch.baddbmm(self.bias, xh, self.weight)  # one batched matmul for all hops: [H, B, hidden]
        z = self.norm(z.transpose(0, 1).reshape(b, -1))  # [B, H*hidden], hop k in columns k*hidden..
        return self.mlp(self.dropout(self.act(z)))


class HOGA(PPModel):
    """Hop-wise graph attention: hop tokens, one multi-head self-attention block, pooled readout, MLP.

    Args:
        in_dim: Feature width ``F``.
        num_hops: ``R`` (the input holds ``R+1`` hop tokens).
        out_dim: Number of outputs.
        hidden: Token width (default: 256).
        heads: Attention heads; must divide ``hidden`` (default: 4).
        layers: Linear layers of the output MLP (default: 2).
        dropout: Dropout in attention, feed-forward and MLP (default: 0.5).
        input_dropout: Dropout on the input features (default: 0).
    """

    name = "hoga"

    def __init__(self, in_dim: int, num_hops: int, out_dim: int, *, hidden: int = 256, heads: int = 4,
                 layers: int = 2, dropout: float = 0.5, input_dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise TrellisUserError(f"--hidden {hidden} must be divisible by --heads {heads} for HOGA")
        h = num_hops + 1
        self.input_dropout = nn.Dropout(input_dropout)
        self.embed = nn.Linear(in_dim, hidden)
        self.hop_embedding = nn.Parameter(torch.zeros(h, hidden))
        nn.init.normal_(self.hop_embedding, std=0.02)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * hidden, hidden))
        self.norm2 = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(hidden, 1)
        self.mlp = _mlp(hidden, hidden, out_dim, layers, dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[B, R+1, F]`` → ``[B, out_dim]``."""
        tok = self.embed(self.input_dropout(x)) + self.hop_embedding  # [B, H, hidden]
        a, _ = self.attn(tok, tok, tok, need_weights=False)
        t = self.norm1(tok + self.dropout(a))
        t = self.norm2(t + self.dropout(self.ffn(t)))
        w = torch.softmax(self.score(t), dim=1)  # [B, H, 1]: how much each hop contributes
        return self.mlp((w * t).sum(dim=1))


#: Registry: name -> class.
PP_MODELS: dict[str, type[PPModel]] = {"sgc": SGC, "sign": SIGN, "hoga": HOGA}


def hops_used(name: str, num_hops: int) -> tuple[int, ...]:
    """Hops model ``name`` reads from a cache of ``R = num_hops``."""
    return _cls(name).hops_used(num_hops)


def _cls(name: str) -> type[PPModel]:
    if name not in PP_MODELS:
        raise TrellisUserError(f"unknown pre-propagation model {name!r}; use one of {', '.join(PP_MODELS)}")
    return PP_MODELS[name]


def build_pp_model(name: str, in_dim: int, num_hops: int, out_dim: int, *, hidden: int = 256, layers: int = 2,
                   heads: int = 4, dropout: float = 0.5, input_dropout: float = 0.0, **extra: object) -> PPModel:
    """Build ``sgc``, ``sign`` or ``hoga`` for ``F = in_dim``, ``R = num_hops`` and ``out_dim`` outputs.

    Raises:
        TrellisUserError: An unknown model or option (``extra``: what ``--model-args`` gave beyond these).
    """
    from trellis.nn.models import refuse_unknown_options

    cls = _cls(name)
    try:
        refuse_unknown_options(name, build_pp_model, extra, common=("hidden", "layers", "heads", "dropout"))
    except ValueError as exc:
        raise TrellisUserError(f"--model {name}: {exc}") from None
    if hidden < 1 or layers < 1:
        raise TrellisUserError("--hidden and --layers must be >= 1")
    builders: dict[str, Callable[[], PPModel]] = {
        "sgc": lambda: SGC(in_dim, out_dim, dropout=input_dropout),
        "sign": lambda: SIGN(in_dim, num_hops, out_dim, hidden=hidden, layers=layers, dropout=dropout,
                             input_dropout=input_dropout),
        "hoga": lambda: HOGA(in_dim, num_hops, out_dim, hidden=hidden, heads=heads, layers=layers,
                             dropout=dropout, input_dropout=input_dropout),
    }
    return builders[cls.name]()


__all__ = ["HOGA", "PP_MODELS", "PPModel", "SGC", "SIGN", "build_pp_model", "hops_used"]
