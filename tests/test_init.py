"""The initial weights' statistics against the rule written out (issue 39: the tests compared init with itself):
N(0, init_std) for every matrix, init_std / sqrt(2 * layers) for the output projection of each residual branch
(attention's o, the MLP's down, each expert's down: GPT-2's and Megatron's scaled init), ones for norm weights,
zeros for biases."""

from __future__ import annotations

import math

import pytest
import torch

from llamatron.models import build_model, get_preset
from llamatron.models.init import materialize

LAYERS = 8  # the scaled std is then init_std / 4


@pytest.mark.parametrize("preset", ["llama-test", "mixtral-test", "qwen3-test", "falcon-test"])
def test_initial_weights_follow_the_scaled_init_rule(preset):
    cfg = get_preset(preset).with_changes({"num_layers": LAYERS, "init_std": 0.05})
    model = materialize(build_model(cfg, device="meta"), cfg, seed=7, device="cpu", dtype=torch.float32)
    scaled = 0.05 / math.sqrt(2 * LAYERS)
    seen = set()
    for name, p in model.named_parameters():
        role = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if "norm" in name and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            want = scaled if role in ("attn.o.weight", "mlp.down.weight", "mlp.experts.down") else 0.05
            # a sample std of n normal draws has a relative standard error of 1 / sqrt(2n): allow 5 of them
            tolerance = 5 / math.sqrt(2 * p.numel())
            assert p.std().item() == pytest.approx(want, rel=tolerance), (name, p.std().item(), want)
            assert abs(p.mean().item()) < 4 * want / math.sqrt(p.numel()), name
            seen.add(want)
    assert seen == {scaled, 0.05}  # both kinds were there to check
