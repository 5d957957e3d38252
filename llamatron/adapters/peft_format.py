"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, each adapter under its
Hugging Face module's name (base_model.model.<module>.lora_A.weight: (r, in), .lora_B.weight: (out, r))."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .lora import LoraLinear
from .targets import LoraTarget

PREFIX = "base_model.model."


def _adapted(model: nn.Module, t: LoraTarget) -> LoraLinear:
    module = model.get_submodule(t.module)
    assert isinstance(module, LoraLinear), t.module
    return module


def peft_state(model: nn.Module, targets: list[LoraTarget]) -> dict[str, torch.Tensor]:
    """The adapters of `model` as PEFT names them."""
    out = {}
    for t in targets:
        m = _adapted(model, t)
        for s, (hf, rows) in enumerate(zip(t.hf_modules, t.rows)):
            out[f"{PREFIX}{hf}.lora_A.weight"] = m.lora_a[s * m.rank : (s + 1) * m.rank].detach().clone()
            out[f"{PREFIX}{hf}.lora_B.weight"] = m.lora_b[rows.to(m.lora_b.device)].detach().clone()
    return out


def load_peft_state(model: nn.Module, targets: list[LoraTarget], state: Mapping[str, torch.Tensor]) -> None:
    """Set `model`'s adapters from a PEFT state dict of the same targets and rank."""
    expected = set(peft_state(model, targets))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(
            f"the adapter does not match this model's --lora-targets/--lora-rank (missing {missing[:3]}, "
            f"unexpected {extra[:3]}); train with the adapter's targets and rank"
        )
    with torch.no_grad():
        for t in targets:
            m = _adapted(model, t)
            for s, (hf, rows) in enumerate(zip(t.hf_modules, t.rows)):
                a, b = state[f"{PREFIX}{hf}.lora_A.weight"], state[f"{PREFIX}{hf}.lora_B.weight"]
                if a.shape != (m.rank, m.lora_a.shape[1]) or b.shape != (len(rows), m.rank):
                    raise CheckpointError(
                        f"{hf}'s adapter has shapes {tuple(a.shape)}, {tuple(b.shape)}, this model "
                        f"({m.rank}, {m.lora_a.shape[1]}), ({len(rows)}, {m.rank}): it belongs to another base model"
                    )
                m.lora_a[s * m.rank : (s + 1) * m.rank] = a
                m.lora_b[rows.to(m.lora_b.device)] = b


def adapter_config(targets: list[LoraTarget], rank: int, alpha: float, dropout: float, base: str) -> dict[str, Any]:
    """adapter_config.json for PEFT's LoraConfig."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({h.rsplit(".", 1)[-1] for t in targets for h in t.hf_modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
