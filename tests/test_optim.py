"""Optimizers as plug-ins (llamatron/optim/): the registry, and that nothing outside it names an optimizer's state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llamatron.optim import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1] / "llamatron"


def test_no_module_outside_the_optimizers_names_their_state():
    """The checkpoint writer/reader, resharding, planner and bench iterate what the optimizer declares (state kinds,
    bytes per parameter); only llamatron/optim/ (and AdamW's fused kernel, which takes the moments) names them."""
    names = {kind for k in OPTIMIZERS.values() for kind in k.state_kinds}
    pattern = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in names))
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in ROOT.rglob("*.py")
        if "optim" not in path.relative_to(ROOT).parts[:1] and path.name != "adamw_kernel.py"
        for line in path.read_text().splitlines()
        if pattern.search(line)
    ]
    assert names and not found, found


def test_optimizer_choices_are_the_registry():
    from llamatron.config.settings import OPTIMIZERS as CHOICES

    assert set(CHOICES) == set(OPTIMIZERS)


def _is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """The published split, written out: a decoder layer's linear weights and its experts (3-D, per expert) take
    Muon; embeddings, the head, norms, biases, the router and a 1-row gate take AdamW."""
    if not name.startswith("layers."):
        return False
    return p.ndim == 3 or (p.ndim == 2 and min(p.shape) > 1 and "router" not in name)


class _TorchReference:
    """torch.optim.Muon on the hidden matrices (each expert its own 2-D parameter) and torch.optim.AdamW on the
    rest, the way the recipes pair them."""

    def __init__(self, model: torch.nn.Module, o, muon_kw: dict):
        named = dict(model.named_parameters())
        self.matrices = {n: p for n, p in named.items() if _is_hidden_matrix(n, p)}
        self.views = {
            n: [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])] if p.ndim == 3 else None
            for n, p in self.matrices.items()
        }
        muon_params = [v for n, p in self.matrices.items() for v in (self.views[n] or [p])]
        self.muon = torch.optim.Muon(muon_params, lr=o.lr, weight_decay=o.weight_decay, **muon_kw)
        rest = [p for n, p in named.items() if n not in self.matrices]
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for p in rest if p.ndim > 1], "weight_decay": o.weight_decay},
                {"params": [p for p in rest if p.ndim <= 1], "weight_decay": 0.0},
            ],
            lr=o.muon_adamw_lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            fused=True,  # the kernel ours runs: the same bits, which Muon's bf16 iteration needs to agree
        )

    def step(self, lr: float, adamw_lr: float) -> None:
        for n, p in self.matrices.items():
            for e, v in enumerate(self.views[n] or []):
                v.grad = p.grad[e].clone()
        for group in self.muon.param_groups:
            group["lr"] = lr
        for group in self.adamw.param_groups:
            group["lr"] = adamw_lr
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for n, p in self.matrices.items():
                for e, v in enumerate(self.views[n] or []):
                    p[e].copy_(v)


@pytest.mark.parametrize(("nesterov", "adjust"), [(True, "match_rms_adamw"), (False, "original")])
def test_muon_matches_torch_muon_and_adamw(nesterov, adjust):
    """--optimizer muon against torch.optim.Muon (hidden matrices, experts one by one) + torch.optim.AdamW (the
    rest, its own learning rate) on a model with every parameter kind (embedding, head, norms, q/k/v biases,
    router, experts, a shared expert and its 1-row gate): the weights agree within 1e-6 after 3 steps (fp32)."""
    from llamatron.config.settings import config_from_values
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
    from llamatron.models import build_model, materialize
    from llamatron.optim import lr_at
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step
    from llamatron.training.validate import validate

    cfg = config_from_values(
        {
            "model": "qwen2-moe-test",
            "model_overrides": {"router_aux_loss_coef": 0.0, "num_layers": 2},
            "mock_data": True,
            "seq_length": 16,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "device": "cpu",
            "clip_grad": 0.0,
            "lr": 2e-2,
            "train_steps": 3,
            "warmup_steps": 1,
            "optimizer": "muon",
            "muon_adamw_lr": 3e-3,
            "muon_nesterov": nesterov,
            "muon_adjust_lr": adjust,
        }
    )
    engine = build_engine(cfg, validate(cfg, 1), build_mesh())
    ref = materialize(build_model(engine.model_cfg), engine.model_cfg, cfg.train.seed, "cpu", torch.float32)
    o = cfg.optim
    torch_opt = _TorchReference(ref, o, {"momentum": o.muon_momentum, "nesterov": nesterov, "adjust_lr_fn": adjust})
    assert set(torch_opt.matrices) == set(engine.optimizer.hidden)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    data = MockDataset(256, 16, 0)
    for step in range(3):
        mbs = micro_batches_for_step(data, step * 4, 4, 2, 1, 0)
        train_step(engine, mbs, step)
        for p in ref.parameters():
            p.grad = None
        total = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
        for mb in mbs:
            (cross_entropy_per_token(ref(mb["input_ids"]), mb["labels"]).sum() / total).backward()
        lr = lr_at(step, o.lr, o.min_lr, o.warmup_steps, cfg.train.train_steps, o.lr_schedule)
        torch_opt.step(lr, lr * o.muon_adamw_lr / o.lr)
    ours = dict(engine.chunks[0].named_parameters())
    for name, p in ref.named_parameters():
        assert (ours[name] - p).abs().max() <= 1e-6, name
        assert (p - initial[name]).abs().max() > 1e-4, name  # every weight moved


def test_muon_coefficients_other_than_three_are_refused_in_one_line():
    from llamatron.config.settings import config_from_values
    from llamatron.errors import ConfigError
    from llamatron.training.validate import validate

    values = {"model": "llama-test", "mock_data": True, "device": "cpu", "optimizer": "muon"}
    validate(config_from_values(values), 1)
    with pytest.raises(ConfigError, match=r"--muon-ns-coefficients takes three numbers .*got 2"):
        validate(config_from_values({**values, "muon_ns_coefficients": [3.0, -4.0]}), 1)
