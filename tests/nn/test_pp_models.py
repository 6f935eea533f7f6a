"""SGC, SIGN and HOGA over hop stacks: shapes, what they read, layouts, and that they learn."""

from __future__ import annotations

import pytest
import torch

from trellis.errors import TrellisUserError
from trellis.nn.pp_models import HOGA, PP_MODELS, SGC, SIGN, build_pp_model, hops_used

R, F, C, B = 3, 12, 5, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def stack(b: int = B, h: int = R + 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, h, F, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(PP_MODELS))
def test_shapes_and_backward(name: str) -> None:
    torch.manual_seed(0)
    m = build_pp_model(name, F, R, C, hidden=16, heads=4)
    x = stack(h=len(hops_used(name, R)))
    out = m(x)
    assert out.shape == (B, C)
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def test_hops_used() -> None:
    assert hops_used("sgc", 3) == (3,)
    assert hops_used("sign", 2) == (0, 1, 2) and hops_used("hoga", 1) == (0, 1)


@pytest.mark.parametrize("name", ["sign", "hoga"])
def test_hop_major_view_equals_contiguous(name: str) -> None:
    """Loaders hand out [B, H, F] views of hop-major [H, B, F] buffers; the result must not depend on it."""
    torch.manual_seed(0)
    m = build_pp_model(name, F, R, C, hidden=16, heads=2).eval()
    hop_major = torch.randn(R + 1, B, F)
    view = hop_major.transpose(0, 1)
    assert not view.is_contiguous()
    torch.testing.assert_close(m(view), m(view.contiguous()))


def test_sgc_reads_only_last_hop() -> None:
    m = SGC(F, C).eval()
    x = stack(h=2)
    y = x.clone()
    y[:, 0] = 1e3
    torch.testing.assert_close(m(x), m(y))
    torch.testing.assert_close(m(x), m.lin(x[:, -1]))


def test_sign_is_per_hop_linear_then_mlp() -> None:
    torch.manual_seed(0)
    m = SIGN(F, R, C, hidden=8, layers=1, dropout=0.0).eval()
    m.norm.running_mean.uniform_()  # a non-trivial normalization, to see it applied per hop and channel
    x = stack()
    per_hop = [x[:, k] @ m.weight[k] + m.bias[k] for k in range(R + 1)]
    ref = m.mlp(m.act(m.norm(torch.cat(per_hop, dim=1))))
    torch.testing.assert_close(m(x), ref)


def test_hoga_is_permutation_sensitive_across_hops() -> None:
    """Hop embeddings make hop order matter (tokens are not a bag)."""
    torch.manual_seed(0)
    m = HOGA(F, R, C, hidden=16, heads=4, dropout=0.0).eval()
    x = stack()
    assert not torch.allclose(m(x), m(x.flip(1)))


@pytest.mark.parametrize("name", list(PP_MODELS))
def test_models_learn_a_propagated_signal(name: str) -> None:
    """A label that lives in hop R (for SGC) / spread over hops is learned to high training accuracy."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 256
    y = torch.randint(0, C, (n,), generator=g)
    centers = torch.randn(C, F, generator=g) * 2
    h = len(hops_used(name, R))
    x = torch.randn(n, h, F, generator=g) * 0.5 + centers[y][:, None, :]
    m = build_pp_model(name, F, R, C, hidden=32, heads=4, dropout=0.0)
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    assert (m(x).argmax(1) == y).float().mean() > 0.95


def test_bad_arguments() -> None:
    with pytest.raises(TrellisUserError, match="unknown pre-propagation model"):
        build_pp_model("gat", F, R, C)
    with pytest.raises(TrellisUserError, match="divisible"):
        build_pp_model("hoga", F, R, C, hidden=10, heads=4)
    with pytest.raises(TrellisUserError, match="hidden"):
        build_pp_model("sign", F, R, C, hidden=0)
