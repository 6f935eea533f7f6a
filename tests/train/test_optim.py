"""Trellis's optimizers train without importing ``torch._dynamo``, and step exactly as torch's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trellis.train.optim import OPTIMIZERS, build_optimizer

REPO = Path(__file__).resolve().parents[2]

# Steps a tiny model with Trellis's optimizer and torch's, before and after something imports torch._dynamo,
# and prints whether the parameters agree bit for bit and whether torch._dynamo was imported before the import.
_SCRIPT = """
import sys, torch
from trellis.train.optim import build_optimizer

def train(make, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = make(model.parameters())
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert torch.is_grad_enabled()
    opt.load_state_dict(opt.state_dict())
    return torch.cat([p.detach().flatten() for p in model.parameters()])

name = sys.argv[1]
torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
             "adagrad": torch.optim.Adagrad}[name]
extra = {"momentum": 0.9} if name == "sgd" else {}
ours = lambda p: build_optimizer(name, p, lr=0.05, weight_decay=1e-3)
theirs = lambda p: torch_cls(p, lr=0.05, weight_decay=1e-3, **extra)
before = train(ours, 5)
print("dynamo before:", "torch._dynamo" in sys.modules)
reference = train(theirs, 5)
import torch._dynamo
after = train(ours, 5)
print("equal:", torch.equal(before, reference) and torch.equal(after, reference))
"""


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_as_torchs_without_importing_dynamo_and_with_it(name):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, name], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["dynamo before: False", "equal: True"], out.stdout


def test_optimizer_is_torchs_class_for_checkpoints_and_isinstance():
    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer("adam", [p], lr=0.1, weight_decay=0.0)
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    p.grad = torch.ones(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))
