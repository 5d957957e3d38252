"""Everything that can be checked before memory is allocated, in one place: each rule's owner says what is wrong
with the plain values it is given (its `*_problems`), and `validate` raises one ConfigError naming the fixes.

The order matters only where a later rule needs an earlier one's result (the data-parallel size needs a sound
mesh, the recompute bound a sound layer split); no rule is written here.
"""

from __future__ import annotations

import re
from dataclasses import asdict

from ..adapters.nf4 import nf4_problems
from ..adapters.problems import lora_problems
from ..config.output_paths import check_output_directory
from ..config.settings import Derived, RunConfig, range_problems
from ..data.batch_rampup import BatchSizes, rampup_problems
from ..data.batches import batch_problems
from ..data.samples import data_settings_problems
from ..errors import ConfigError
from ..kernels.choices import KernelChoices
from ..models import ModelConfig
from ..models.families import model_problems
from ..models.moe_balance import balancing_run_problems
from ..objectives.extra_heads import extra_heads_problems
from ..objectives.grpo_checks import check_grpo
from ..objectives.preference import preference_problems
from ..optim import optimizer_problems
from ..parallel.context import context_problems
from ..parallel.expert import expert_parallel_problems
from ..parallel.fsdp import fsdp_problems
from ..parallel.grad_buffer import reduce_dtype_problems
from ..parallel.layout import ParallelLayout
from ..parallel.mesh import comm_problems
from ..parallel.pipeline import pipeline_problems, split_layers
from ..parallel.schedules import schedule_problems
from ..parallel.tensor import tensor_parallel_problems
from .checkpointing import resume_problems
from .engine import recompute_problems
from .eval_tasks import eval_task_problems
from .evaluation import resolve_eval_metrics
from .fp8 import fp8_problems
from .kernel_settings import kernel_problems
from .logging_sinks import check_output_paths, check_sink_dependencies


def _raise_if(problems: list[str], before: str = "", after: str = "") -> None:
    if problems:
        raise ConfigError(before + "; ".join(problems) + after)


def _validate_layout(
    cfg: RunConfig, world_size: int, model: ModelConfig, world_flag: str | None = None
) -> tuple[ParallelLayout, int]:
    """The mesh, tensor and pipeline split and the batch: (the layout on the world, micro-batches per rank and
    step)."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    _raise_if(p.world_problems(world_size, world_flag))
    layout = p.on(world_size)
    dp = layout.dp
    _raise_if(
        tensor_parallel_problems(model, p.tp, p.sequence_parallel)
        + expert_parallel_problems(model, p.ep, p.cp, p.tp, p.etp, p.sequence_parallel)
    )
    _raise_if(context_problems(d.seq_length, p.cp, p.tp if p.sequence_parallel else 1))
    _raise_if(pipeline_problems(model.num_layers, p.pp, p.vpp, p.pp_layers))
    _raise_if(model.layout_problems(p.tp, p.pp, p.cp))
    _raise_if(extra_heads_problems(model, dp * p.cp if p.fsdp else 0))
    given = [k for k in asdict(p) if k in cfg.explicit]
    _raise_if(
        fsdp_problems(
            p.fsdp,
            p.fsdp_keep_params_in_backward,
            p.fsdp_prefetch,
            p.fsdp_shard_group,
            dp * p.cp,
            given,
            p.tp,
            p.pp,
            p.cp,
            p.ep,
            t.fp8,
            cfg.lora.lora_rank,
        )
    )
    largest = max(split_layers(model.num_layers, p.pp, p.vpp, p.pp_layers))
    _raise_if(recompute_problems(t.recompute, t.recompute_layers, largest, p.pp * p.vpp))
    _raise_if(batch_problems(t.global_batch_size, t.micro_batch_size, dp))
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    _raise_if(rampup_problems(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size * dp))
    if p.pp > 1:
        for size in BatchSizes.of(t.global_batch_size, t.rampup_batch_size).sizes():
            _raise_if(schedule_problems(size // (t.micro_batch_size * dp), p.pp, p.vpp))
    return layout, accum


def resolve_device(device: str, precision: str, cuda_available: bool) -> tuple[str, str]:
    """(device, dtype name) of --device and --precision: auto is cuda when available, bf16 on cuda, fp32 elsewhere."""
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
    return device, precision if precision != "auto" else ("bf16" if device == "cuda" else "fp32")


def _validate_run(cfg: RunConfig, model: ModelConfig, device: str, dtype_name: str) -> None:
    """The settings against each other, the model, the device and the precision; then where records go."""
    p, t, o, d = cfg.parallel, cfg.train, cfg.optim, cfg.data
    _raise_if(model.seq_length_problems(d.seq_length, t.model))
    _raise_if(optimizer_problems(o) + resume_problems(t.finetune, t.load))
    _raise_if(reduce_dtype_problems(dtype_name, p.grad_reduce_dtype) + comm_problems(p.dp_comm_max_ctas, device))
    _raise_if(kernel_problems(KernelChoices.of(t, o), p.tp, model, device, dtype_name))
    tokens = t.micro_batch_size * d.seq_length // p.cp
    _raise_if(
        fp8_problems(
            t.fp8, t.fp8_emulate, device, dtype_name, model, p.tp, tokens, head=t.fp8_head, experts=t.fp8_experts
        )
    )
    _raise_if(balancing_run_problems(model, cfg.lora.lora_rank > 0, p.fsdp))
    _raise_if(lora_problems(cfg.lora, model, [k for k in asdict(cfg.lora) if k in cfg.explicit], p.tp))
    layout = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep}
    _raise_if(nf4_problems(cfg.lora.base_precision, cfg.lora.lora_rank, t.load, t.save, layout, p.fsdp, t.fp8))
    document_flags = [
        f"--{n.replace('_', '-')}"
        for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
        if getattr(d, n)
    ]
    _raise_if(data_settings_problems(d.data, d.split, d.mock_data, d.sft_data, d.tokenizer, document_flags))
    other_data = [
        flag for flag, given in (("--data", d.data), ("--sft-data", d.sft_data), ("--mock-data", d.mock_data)) if given
    ]
    ob = cfg.objective
    _raise_if(preference_problems(ob.objective, d.preference_data, other_data, t.micro_batch_size))
    resolve_eval_metrics(t.eval_metrics)
    demo_corpus = not (d.data or d.mock_data or d.sft_data or d.preference_data)  # brings its own tokenizer
    _raise_if(eval_task_problems(t.eval_tasks, t.eval_include_path, t.eval_limit, layout, d.tokenizer, demo_corpus))
    check_sink_dependencies(t.tensorboard_dir, t.wandb_project)
    check_output_paths(t.metrics_file, t.tensorboard_dir)
    if d.data_cache_path:
        check_output_directory(d.data_cache_path, "--data-cache-path", "the index caches")


def shape_fix(cfg: RunConfig, problems: list[str]) -> str:
    """Where a model shape that cannot be trained came from: the flags that set model fields (Megatron-LM's
    --num-layers ..., --model-override FIELD=VALUE; those whose field the problems name, where they name any), the
    YAML model_overrides, a checkpoint's model config (--load)."""
    flagged = cfg.override_flags
    named = {name: flag for name, flag in flagged.items() if re.search(rf"\b{name}\b", " ".join(problems))}
    sources = list((named or flagged).values())
    if set(cfg.model_overrides) - set(cfg.override_flags) or not (sources or cfg.train.load):
        sources.append("the YAML model_overrides")
    if cfg.train.load:
        sources.append("the checkpoint's model config")
    return "fix " + (" or ".join(sources) if len(sources) < 3 else f"{', '.join(sources[:-1])} or {sources[-1]}")


def validate(
    cfg: RunConfig,
    world_size: int = 1,
    cuda_available: bool = False,
    model: ModelConfig | None = None,
    world_flag: str | None = None,
) -> Derived:
    """Check everything that can be checked before memory is allocated; raise ConfigError naming the fix.

    `model` is the architecture to check against (default: the preset of --model); `world_flag` the flag that
    gave the world size when it is not the processes launched (plan's --gpus).
    """
    _raise_if(range_problems(cfg))
    model = model or cfg.model_config()
    shape_problems = model_problems(model, cfg.model_overrides)
    _raise_if(shape_problems, "the model's shape cannot be trained: ", f" ({shape_fix(cfg, shape_problems)})")
    layout, accum = _validate_layout(cfg, world_size, model, world_flag)
    device, dtype_name = resolve_device(cfg.train.device, cfg.train.precision, cuda_available)
    _validate_run(cfg, model, device, dtype_name)
    check_grpo(cfg, layout.dp, model.max_seq_length)
    compile_layers = cfg.train.compile if cfg.train.compile is not None else device == "cuda"
    return Derived(layout, accum, device, dtype_name, compile_layers)


__all__ = ["resolve_device", "validate"]
