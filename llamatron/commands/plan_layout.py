"""`llamatron plan` with a given layout (flags, or a train YAML's): its memory and expected speed, not a search.

The layout is checked by the same rules `train` applies (training.validate), so a plan that evaluates is a run
that starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from ..config.model_overrides import merged_overrides, parse_model_overrides
from ..config.settings import config_from_values
from ..config.yaml_errors import yaml_error_line
from ..errors import ConfigError
from ..models import ModelConfig
from ..planning.plan import Plan, Precision, SpeedAssumptions, estimate_speed, layout_memory, run_layout
from ..training.validate import validate

# (flag, type, help) of the layout flags plan takes; their config keys are the flags with underscores.
_LAYOUT_FLAGS: list[tuple[str, type, str]] = [
    ("tp", int, "tensor-parallel size"),
    ("pp", int, "pipeline stages"),
    ("vpp", int, "virtual pipeline chunks per stage"),
    ("cp", int, "context-parallel size"),
    ("ep", int, "expert-parallel size (a mixture of experts)"),
    ("etp", int, "expert tensor-parallel size: 1 keeps each expert whole over ep x tp ranks (default: tp)"),
    ("micro-batch-size", int, "samples per micro-batch"),
    ("recompute", str, "none, selective or full"),
    ("recompute-layers", int, "recompute only the first N layers of each chunk"),
    ("fsdp-shard-group", int, "with --fsdp: hybrid sharding, shard over groups of N data-parallel ranks"),
]
_SWITCHES = ["distributed_optimizer", "fsdp", "fsdp_keep_params_in_backward"]
_LAYOUT_KEYS = [f.replace("-", "_") for f, *_ in _LAYOUT_FLAGS] + _SWITCHES
# What plan reads of a train YAML: the model, its shape and the layout (data, checkpoints and logging are the run's).
_PLANNED = {
    *("model", "model_overrides", "seq_length", "global_batch_size", "sequence_parallel", "pp_layers"),
    *("fp8", "fp8_experts", "optimizer"),
}


def planned_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The --config YAML's model, shape and layout, with the command's flags over them (--model-override over the
    YAML's model_overrides, field by field)."""
    values: dict[str, Any] = {}
    if args.config is not None:
        path = Path(args.config)
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ConfigError(f"--config {path} cannot be read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error_line(f"--config {path}", e)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path} must hold a mapping of settings (as for `llamatron train`)")
        keys = _PLANNED | set(_LAYOUT_KEYS)
        values = {k: v for k, v in loaded.items() if k in keys}
    given = {"model": args.model, "seq_length": args.seq_length, "global_batch_size": args.global_batch_size}
    given.update({k: getattr(args, k) for k in _LAYOUT_KEYS})
    values.update({k: v for k, v in given.items() if v is not None})
    flagged = parse_model_overrides(args.model_override)
    from_file = values.get("model_overrides") or {}
    if flagged.values and isinstance(from_file, dict):  # not a mapping: config_from_values says so
        values["model_overrides"] = merged_overrides(from_file, {}, flagged)
    return values


def evaluate_layout(
    settings: dict[str, Any],
    gpus: int,
    seq_length: int,
    gpus_per_node: int,
    precision: Precision,
    speed: SpeedAssumptions = SpeedAssumptions(),
) -> tuple[Plan, ModelConfig]:
    """Memory and (ranking-model) speed of the layout `settings` give on `gpus` GPUs, and the model (raises
    ConfigError as train would)."""
    # the recipe's GPU check needs the GPU: not here (plan checks the FP8 flags against the model itself)
    values = {k: v for k, v in settings.items() if k not in ("fp8", "fp8_experts")}
    values.setdefault("global_batch_size", max(1, 2**22 // seq_length))  # about 4M tokens, as the search
    if "distributed_optimizer" not in values and not values.get("fsdp"):
        values["distributed_optimizer"] = gpus > 1
    if values.get("tp", 1) > 1:
        values.setdefault("sequence_parallel", True)
    cfg = config_from_values({**values, "seq_length": seq_length, "device": "cuda", "mock_data": True})
    derived = validate(cfg, gpus, cuda_available=True, world_flag="--gpus")
    model = cfg.model_config()
    lay = run_layout(cfg, derived.dp)
    memory = layout_memory(model, lay, seq_length, precision)
    plan = Plan(
        lay,
        memory,
        estimate_speed(
            model, lay, seq_length, gpus, gpus_per_node, speed, fp8=precision.fp8, optimizer_name=precision.optimizer
        ),
    )
    return plan, model
