"""LoRA's rules for a run, checked before any memory is spent (training/validate.py asks)."""

from __future__ import annotations

from collections.abc import Sequence

from ..config.settings import LoraConfig
from ..errors import ConfigError
from ..models import ModelConfig, build_model
from ..models.moe import SharedExpert
from .peft_format import peft_dir_problems
from .targets import find_targets, requested


def lora_problems(lora: LoraConfig, model: ModelConfig, given: Sequence[str] = (), tp: int = 1) -> list[str]:
    """LoRA's rules: adapter settings (`given`: the --lora-* settings the user set) only with a rank; targets that
    name linears of the model, none of a shared expert's under tensor parallelism (parallel/expert.py splits those
    linears in place, not as the parallel layers whose split the adapters follow); an adapter to start from that
    fits them."""
    if lora.lora_rank == 0:
        flags = [f"--{name.replace('_', '-')}" for name in given if name != "lora_rank"]
        if lora.lora_init_from and "--lora-init-from" not in flags:
            flags.append("--lora-init-from")
        if flags:
            return [
                f"{', '.join(flags)} set up LoRA adapters, but --lora-rank is 0 (no LoRA): give --lora-rank R "
                "(e.g. 16), or drop them"
            ]
        return []
    built = build_model(model, device="meta")
    try:
        found = find_targets(built, model, requested(lora.lora_targets))
    except ConfigError as e:
        return [str(e)]
    # B·A has rank at most min(in, out) of its linear: a rank above every adapted linear's adds nothing but memory
    # (10^12 was an allocation traceback)
    widest = max(min(t.shape[1], len(rows)) for t in found for rows in t.rows)
    if lora.lora_rank > widest:
        return [
            f"--lora-rank {lora.lora_rank} is above every adapted linear's width: an adapter's rank is at most the "
            f"narrower of its linear's input and output ({widest} at most in these targets); give --lora-rank "
            f"{widest} or less"
        ]
    shared = {f"{name}." for name, m in built.named_modules() if isinstance(m, SharedExpert)}
    in_shared = sorted(
        {h.rsplit(".", 1)[-1] for t in found if t.module.startswith(tuple(shared)) for h in t.hf_modules}
    )
    if tp > 1 and in_shared:
        return [
            f"--lora-targets adapts a shared expert's {','.join(in_shared)}, which --tp {tp} splits outside the "
            f"parallel layers LoRA's adapters follow: use --tp 1, or targets without {','.join(in_shared)}"
        ]
    if lora.lora_init_from:
        return peft_dir_problems(lora.lora_init_from, lora.lora_rank, lora.lora_alpha, found)
    return []


__all__ = ["lora_problems"]
