"""The lines `train` prints once at its start (rank 0): the model, the layout and, under LoRA, what trains, in
PEFT's words (print_trainable_parameters), so that a PEFT user can compare them."""

from __future__ import annotations

from math import prod

from ..adapters.peft_format import adapter_config
from ..adapters.targets import adapter_shapes, find_targets, requested
from ..config.settings import Derived, RunConfig
from ..models import ModelConfig, build_model
from ..models.inventory import active_params, num_params


def _short(n: int) -> str:
    """A count as people write it: 6.74B, 5.3M, 151K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def trainable_line(trainable: int, total: int) -> str:
    """peft's PeftModel.print_trainable_parameters line."""
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"


def _model_line(label: str, model: ModelConfig) -> str:
    total = num_params(model)
    line = f"model: {label}, {total:,} parameters ({_short(total)}), {model.num_layers} layers"
    if model.is_moe:
        active = active_params(model)
        line += f" ({model.num_experts} experts, top-{model.experts_per_token}: {_short(active)} active a token)"
    return line


def _layout_line(cfg: RunConfig, derived: Derived) -> str:
    p = cfg.parallel
    pp = f"pp {p.pp}" + (f" (vpp {p.vpp})" if p.vpp > 1 else "")
    etp = f" (etp {p.etp})" if p.etp is not None and p.etp != p.tp else ""
    processes = f"{derived.world_size} process{'es' if derived.world_size > 1 else ''}"
    on = {True: "on", False: "off"}
    return (
        f"layout: {processes}, tp {p.tp} x {pp} x cp {p.cp} x dp {derived.dp}, ep {p.ep}{etp}; fsdp "
        f"{on[p.fsdp]}, distributed optimizer {on[p.distributed_optimizer]}; {derived.device}, {derived.dtype_name}"
    )


def _lora_lines(cfg: RunConfig, model: ModelConfig) -> list[str]:
    lo = cfg.lora
    targets = find_targets(build_model(model, device="meta"), model, requested(lo.lora_targets))
    names = adapter_config(targets, lo.lora_rank, lo.lora_alpha, lo.lora_dropout, "")["target_modules"]
    trainable = sum(prod(s) for s in adapter_shapes(model, lo.lora_rank, lo.lora_targets).values())
    return [
        f"LoRA: rank {lo.lora_rank}, alpha {lo.lora_alpha:g}, targets {','.join(names)} (the rest frozen)",
        trainable_line(trainable, num_params(model) + trainable),
    ]


def startup_summary(cfg: RunConfig, derived: Derived, model: ModelConfig, label: str) -> list[str]:
    """What the run trains and how it is laid out; `label`: the model as the user named it."""
    lines = [_model_line(label, model), _layout_line(cfg, derived)]
    return lines + (_lora_lines(cfg, model) if cfg.lora.lora_rank else [])


__all__ = ["startup_summary", "trainable_line"]
