"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, each adapter under its
Hugging Face module's name (base_model.model.<module>.lora_A.weight: (r, in), .lora_B.weight: (out, r))."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.reader import inside, open_safetensors
from ..errors import CheckpointError
from .lora import LoraLinear
from .targets import LoraTarget

PREFIX = "base_model.model."


def _adapted(model: nn.Module, t: LoraTarget) -> LoraLinear:
    module = model.get_submodule(t.module)
    assert isinstance(module, LoraLinear), t.module
    return module


def peft_tensors(target: LoraTarget, a: torch.Tensor, b: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    """One adapted linear's A (S*r, in) and B (out, r) as PEFT's per-module lora_A / lora_B."""
    out = {}
    for s, (hf, rows) in enumerate(zip(target.hf_modules, target.rows)):
        out[f"{PREFIX}{hf}.lora_A.weight"] = a[s * rank : (s + 1) * rank].detach().clone()
        out[f"{PREFIX}{hf}.lora_B.weight"] = b[rows.to(b.device)].detach().clone()
    return out


def peft_state(model: nn.Module, targets: list[LoraTarget]) -> dict[str, torch.Tensor]:
    """The adapters of `model` as PEFT names them."""
    out = {}
    for t in targets:
        m = _adapted(model, t)
        out.update(peft_tensors(t, m.lora_a, m.lora_b, m.rank))
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


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_OTHER_METHODS = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform")


def peft_dir_problems(path: str, rank: int, alpha: float, targets: list[LoraTarget]) -> list[str]:
    """A PEFT adapter directory for --lora-init-from: plain LoRA of this rank, alpha and targets (its config only;
    the tensors' names and shapes are checked as they are read)."""
    d = Path(path)
    if not (d / ADAPTER_CONFIG).is_file():
        return [f"--lora-init-from {path}: no {ADAPTER_CONFIG} there; give a PEFT adapter directory"]
    if not (d / ADAPTER_WEIGHTS).is_file():
        pickled = " (adapter_model.bin is a pickle, which llamatron never loads: save it with safetensors)"
        return [f"--lora-init-from {path}: no {ADAPTER_WEIGHTS}{pickled if (d / 'adapter_model.bin').exists() else ''}"]
    try:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return [f"--lora-init-from {path}: {ADAPTER_CONFIG} is not JSON ({err})"]
    if not isinstance(config, dict):
        kind = type(config).__name__.replace("NoneType", "null")
        return [f"--lora-init-from {path}: {ADAPTER_CONFIG} holds a JSON {kind}, not PEFT's object of settings"]
    if config.get("peft_type") != "LORA":
        return [f"--lora-init-from {path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})"]
    other = [k for k in _OTHER_METHODS if config.get(k)]
    if other:
        return [f"--lora-init-from {path}: the adapter uses {', '.join(other)}, which llamatron's LoRA does not"]
    ours = adapter_config(targets, rank, alpha, 0.0, "")
    theirs = {
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": config.get("target_modules"),
    }
    if isinstance(theirs["target_modules"], list):
        theirs["target_modules"] = sorted(theirs["target_modules"])
    if any(theirs[k] != ours[k] for k in theirs):
        modules = theirs["target_modules"]
        modules = ",".join(modules) if isinstance(modules, list) else modules
        return [
            f"--lora-init-from {path} is an adapter of rank {theirs['r']}, alpha {theirs['lora_alpha']}, targets "
            f"{modules}: train with --lora-rank {theirs['r']} --lora-alpha {theirs['lora_alpha']} "
            f"--lora-targets {modules}"
        ]
    return []


def read_peft_dir(path: str, targets: list[LoraTarget], rank: int) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT directory as llamatron's full tensors: NAME.lora_a (S*r, in), NAME.lora_b (out, r)."""
    file = inside(Path(path), ADAPTER_WEIGHTS, f"--lora-init-from {path}")
    with open_safetensors(file, "give a PEFT adapter directory written completely") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    expected = {
        k
        for t in targets
        for hf in t.hf_modules
        for k in (f"{PREFIX}{hf}.lora_A.weight", f"{PREFIX}{hf}.lora_B.weight")
    }
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(
            f"{file} does not hold this model's adapters (missing {missing[:2]}, unexpected {extra[:2]}): it "
            "belongs to another base model"
        )
    out = {}
    for t in targets:
        cols, b = t.shape[1], torch.zeros(t.shape[0], rank)
        a = []
        for hf, rows in zip(t.hf_modules, t.rows):
            a_part, b_part = state[f"{PREFIX}{hf}.lora_A.weight"], state[f"{PREFIX}{hf}.lora_B.weight"]
            if a_part.shape != (rank, cols) or b_part.shape != (len(rows), rank):
                raise CheckpointError(
                    f"{file}: {hf}'s adapter is {tuple(a_part.shape)}, {tuple(b_part.shape)}; this model's "
                    f"({rank}, {cols}), ({len(rows)}, {rank}): it belongs to another base model"
                )
            a.append(a_part.float())
            b[rows] = b_part.float()
        out[f"{t.module}.lora_a"], out[f"{t.module}.lora_b"] = torch.cat(a), b
    return out
