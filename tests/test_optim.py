"""models.optim.Adam: torch.optim.Adam's parameters bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.optim import Adam
from models.survival import build_survival_model


@pytest.mark.parametrize("weight_decay", [0.0, 1e-4, 0.1])
def test_the_parameters_are_torch_adams_bit_for_bit(weight_decay):
    model = build_survival_model("hazard_mlp", in_features=6, cuts=np.linspace(0, 10, 8), seed=0)
    twin = copy.deepcopy(model)
    ours = Adam(model.net.parameters(), lr=0.01, weight_decay=weight_decay)
    reference = torch.optim.Adam(twin.net.parameters(), lr=0.01, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(1)
    for step in range(40):
        x = torch.randn(32, 6, generator=generator)
        time = torch.rand(32, generator=generator, dtype=torch.float64) * 10
        event = (torch.rand(32, generator=generator) < 0.6).float()
        for net, optimizer in ((model, ours), (twin, reference)):
            optimizer.zero_grad(set_to_none=True)
            net.loss(x, time, event).backward()
            if step % 7 == 3:  # a parameter without a gradient this step is left alone, its moments too
                net.net.layers[0].bias.grad = None
            optimizer.step()
        for mine, theirs in zip(model.net.parameters(), twin.net.parameters(), strict=True):
            assert torch.equal(mine, theirs)


def test_a_training_message_does_not_import_torch_dynamo():
    code = ("import sys, torch; from models.optim import Adam; net = torch.nn.Linear(3, 1); "
            "o = Adam(net.parameters(), lr=0.1, weight_decay=0.01); net(torch.ones(2, 3)).sum().backward(); o.step(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == "False"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lr=0"):
        Adam(torch.nn.Linear(2, 1).parameters(), lr=0)
