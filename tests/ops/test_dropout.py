import torch

from trellis.ops.dropout import dropout


def test_dropout_rate_scale_and_gradient():
    torch.manual_seed(0)
    x = torch.ones(200_000, dtype=torch.float64, requires_grad=True)
    y = dropout(x, 0.3, True)
    kept = y != 0
    assert abs(kept.double().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.7))
    (g,) = torch.autograd.grad((y * torch.arange(200_000.0, dtype=torch.float64)).sum(), x)
    # the backward regenerates the same mask from the seed
    torch.testing.assert_close(g, torch.where(kept, torch.arange(200_000.0, dtype=torch.float64) / 0.7, 0.0))


def test_dropout_is_reproducible_from_torch_seed_and_identity_in_eval():
    x = torch.randn(1000, 7)
    torch.manual_seed(5)
    a = dropout(x, 0.5, True)
    torch.manual_seed(5)
    b = dropout(x, 0.5, True)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, dropout(x, 0.5, True))
    assert dropout(x, 0.5, False) is x


def test_tile_seed_gives_each_slice_its_part_of_the_whole_mask():
    from trellis.ops.dropout import apply_, tile_seed

    x = torch.randn(37, 5)
    seed = 2**62 - 17
    whole = apply_(x.clone(), 0.4, seed=seed)
    for r0, r1 in ((0, 1), (1, 8), (8, 30), (30, 37)):
        part = apply_(x[r0:r1].clone(), 0.4, seed=tile_seed(seed, r0 * 5))
        assert torch.equal(part, whole[r0:r1])


def test_keyed_rows_give_each_row_the_mask_of_its_key_and_refuse_other_row_counts():
    import numpy as np
    import pytest

    from trellis.ops.dropout import keyed_rows

    x = torch.randn(50, 6)
    torch.manual_seed(3)
    whole = dropout(x, 0.5, True)
    keys = np.array([7, 3, 41, 0], dtype=np.int64)
    torch.manual_seed(3)
    with keyed_rows(nodes=keys):
        part = dropout(x[keys], 0.5, True)
        with pytest.raises(RuntimeError, match="5 nodes rows under 4 row keys"):
            dropout(x[:5], 0.5, True)
        dropout(x[:5], 0.5, True, rows="edges")  # no edge keys: positional
    assert torch.equal(part, whole[keys])
