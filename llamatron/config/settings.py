"""Typed run configuration, as data: the sections' dataclasses, and their parsing from YAML and flags.

Every field of the sections below is a flag (`--micro-batch-size`) and a YAML
key (`micro_batch_size`), in one flat namespace. Precedence: defaults < YAML
(`--config FILE`) < flags. Each number declares its range here; every other rule
belongs to the module that applies it, and training/validate.py asks them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..data.cache import KEEP_PER_KIND
from ..errors import ConfigError
from ..kernels.choices import ATTENTION_BACKENDS, TRITON_SETTINGS
from ..models import ModelConfig, get_preset
from ..models.families import DEFAULT_PRESET, PRESET_NAMES, families_with_field
from ..parallel.layout import LayoutChoice, ParallelLayout
from .megatron_flags import (
    MODEL_ALIASES,
    add_model_aliases,
    add_setting_aliases,
    alias_problems,
    model_overrides_from_flags,
    settings_from_aliases,
)
from .model_overrides import add_model_override_argument, did_you_mean, merged_overrides, parse_model_overrides
from .objective_settings import ObjectiveConfig
from .ranges import Range, above, at_least, problem, setting
from .yaml_errors import yaml_error_line

# --fp8's recipes (torchao.float8's names; training/fp8.py applies them)
FP8_RECIPES = ("none", "tensorwise", "rowwise")
OPTIMIZERS = ("adamw", "muon")  # --optimizer (llamatron/optim/'s registry)
MUON_ADJUST_LR_HELP = "a Muon matrix's lr: --lr x 0.2 sqrt(max(rows, cols)) (its update's RMS AdamW's) or original"


_f = setting  # every section's fields below


def _kernel_switch(
    what: str, triton: str, torch_path: str = "the plain expression, fused by --compile", auto_also: str = ""
) -> Any:
    """A kernel switch (auto | triton | torch): auto runs the Triton kernels on CUDA when triton is installed
    (kernel_settings.kernel_choices resolves it)."""
    return _f(
        "auto",
        f"{what}: triton ({triton}) or torch ({torch_path}); auto: triton on CUDA when triton is "
        f"installed{auto_also}; for comparison and debugging",
        TRITON_SETTINGS,
    )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(LayoutChoice):
    """The parallel layout the flags choose (its fields: parallel/layout.py's LayoutChoice, which the world size
    turns into the ParallelLayout the mesh, planner and simulator read) and how its communication runs: the knobs
    below change speed and memory, never which rank holds what."""

    fsdp_keep_params_in_backward: bool = _f(
        False, "with --fsdp, keep each layer's gathered parameters from forward to its backward (no re-gather)"
    )
    fsdp_prefetch: bool = _f(True, "with --fsdp, issue the next layer's all-gather before this layer computes")
    tp_comm_overlap: bool = _f(
        True,
        "with --tp > 1, column-parallel backward runs the input gradient's "
        "reduce-scatter/all-reduce while the weight gradient is computed",
    )
    overlap_grad_reduce: bool = _f(True, "reduce gradient buckets while backward runs")
    overlap_param_gather: bool = _f(True, "all-gather updated parameters during the next forward")
    bucket_size: int = _f(
        40_000_000, "gradient bucket size in elements", allowed=at_least(1, "elements per gradient bucket")
    )
    grad_reduce_dtype: str = _f("fp32", "dtype of the gradient reduction", ("fp32", "bf16"))
    dp_comm_max_ctas: int | None = _f(
        None,
        "NCCL: at most this many thread blocks (SMs) for the data-parallel "
        "group's collectives, so overlapped ones slow the compute less "
        "(default: NCCL's choice)",
        allowed=at_least(1, "or left unset for NCCL's choice"),
    )


@dataclass
class OptimConfig:
    optimizer: str = _f("adamw", "adamw, or muon: Muon on the decoder layers' matrices, AdamW on the rest", OPTIMIZERS)
    lr: float = _f(3e-4, "peak learning rate", allowed=at_least(0))
    min_lr: float = _f(3e-5, "learning-rate floor of the decay (at most --lr)", allowed=at_least(0))
    lr_schedule: str = _f("cosine", "learning-rate decay after warm-up", ("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "linear warm-up steps", allowed=at_least(0))
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases)", allowed=at_least(0))
    adam_beta1: float = _f(0.9, "AdamW beta1", allowed=Range(0, 1, high_open=True))
    adam_beta2: float = _f(0.95, "AdamW beta2", allowed=Range(0, 1, high_open=True))
    adam_eps: float = _f(1e-8, "AdamW epsilon", allowed=above(0))
    clip_grad: float = _f(1.0, "clip gradients to this global norm (0: off)", allowed=at_least(0, "0: off"))
    muon_momentum: float = _f(0.95, "Muon's momentum", allowed=Range(0, 1, high_open=True))
    muon_nesterov: bool = _f(True, "Muon's Nesterov momentum")
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations", allowed=Range(1, 99))
    muon_ns_coefficients: list[float] = _f([3.4445, -4.7750, 2.0315], "Muon's Newton-Schulz coefficients a b c")
    muon_ns_dtype: str = _f("bf16", "Muon's Newton-Schulz dtype (bf16: torch.optim.Muon's)", ("bf16", "fp32"))
    muon_adjust_lr: str = _f("match_rms_adamw", MUON_ADJUST_LR_HELP, ("match_rms_adamw", "original"))
    muon_adamw_lr: float | None = _f(None, "Muon runs: peak lr of what AdamW updates (def. --lr)", allowed=at_least(0))
    adamw_kernel: str = _f(
        "auto",
        "AdamW update: triton (one pass that also writes the model weights; CUDA) or "
        "torch (torch's fused kernel, then a copy into the weights); auto: triton on "
        "CUDA when triton is installed",
        ("auto", "torch", "triton"),
    )


@dataclass
class DataConfig:
    data: str | None = _f(None, "dataset prefix, or W1 PREFIX1 W2 PREFIX2 ... to blend", words=True)
    mock_data: bool = _f(False, "deterministic synthetic tokens with learnable structure")
    tokenizer: str | None = _f(None, "tokenizer (HF directory, tokenizer.json or tokenizer.model)")
    split: str = _f("98,2,0", "train,valid,test split of the documents")
    seq_length: int = _f(512, "tokens per sample", allowed=at_least(1))
    reset_position_ids: bool = _f(False, "positions restart at 0 after each end-of-document (EOD) token")
    reset_attention_mask: bool = _f(False, "attention does not cross EOD tokens (each document attends only to itself)")
    eod_mask_loss: bool = _f(False, "no loss on predicting the EOD token")
    sft_data: str | None = _f(None, "instruction-tuning prefix written by `preprocess --sft` (PREFIX + PREFIX_mask)")
    pack: bool = _f(True, "--sft-data: pack conversations into full sequences (--no-pack: one padded per sample)")
    preference_data: str | None = _f(
        None, "--objective dpo: preference pairs written by `preprocess --preference` (PREFIX_chosen, ...)"
    )
    data_cache_path: str | None = _f(
        None,
        "directory for the index caches of --data / --sft-data (default: beside the data); it keeps each "
        f"dataset's {KEEP_PER_KIND} most recently used indexes of each kind (train, valid, ...)",
    )


@dataclass
class TrainConfig:
    model: str = _f(DEFAULT_PRESET, f"model preset ({', '.join(PRESET_NAMES)})")
    micro_batch_size: int = _f(4, "samples per forward/backward on one rank", allowed=at_least(1))
    global_batch_size: int = _f(16, "samples per optimizer step over all data-parallel ranks", allowed=at_least(1))
    train_steps: int = _f(100, "optimizer steps", allowed=at_least(1, "a run of 0 steps trains and saves nothing"))
    rampup_batch_size: list[int] | None = _f(
        None, "START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over the first SAMPLES samples"
    )
    # numpy seeds the data order: it takes 0..2**32-1
    seed: int = _f(1234, "seed of initialisation, data order and dropout", allowed=Range(0, 2**32 - 1))
    precision: str = _f(
        "auto", "parameter/compute dtype (auto: bf16 on GPU, fp32 on CPU)", ("auto", "fp32", "bf16", "fp16")
    )
    fp8: str = _f(
        "none",
        "FP8 matmuls in the decoder's linear layers on top of bf16 (torchao.float8; H100/H200 or newer; "
        "pip install -e '.[fp8]'): tensorwise (one scale per tensor, fastest) or rowwise (a scale per row)",
        FP8_RECIPES,
    )
    fp8_emulate: bool = _f(False, "with --fp8: emulate FP8's numerics without FP8 hardware (slow; for tests on CPU)")
    fp8_head: bool = _f(False, "with --fp8: the output head's matmul in FP8 too (faster; the logits lose precision)")
    fp8_experts: bool = _f(
        False,
        "with --fp8 on a mixture of experts: its experts' grouped GEMMs in FP8 too (torchao's rowwise recipe; "
        "compute capability 9.0/10.0; off by default: slower than bf16 on an H200 at the shapes measured, "
        "benchmarks/RESULTS.md run 23)",
    )
    recompute: str = _f("none", "activation recompute", ("none", "selective", "full"))
    recompute_layers: int | None = _f(
        None, "recompute only the first N layers of each chunk (default: all)", allowed=at_least(0)
    )
    initial_loss_scale: float = _f(
        2.0**16,
        "fp16: starting dynamic loss scale (halved on overflow, doubled after 1000 clean steps)",
        allowed=above(0),
    )
    compile: bool | None = _f(None, "torch.compile each decoder layer (default: on for cuda, off for cpu)")
    attention_backend: str = _f(
        "auto",
        "attention kernel: a scaled_dot_product_attention backend (auto: SDPA's "
        "fastest, cuDNN on Hopper; auto never picks fa4; the others for comparison "
        "and debugging), or fa4: FlashAttention 4 for plain causal attention (Hopper "
        "or newer, bf16/fp16, head dims 64/96/128; document masks and sliding "
        "windows still run on SDPA; pip install -e '.[fa4]')",
        ATTENTION_BACKENDS,
    )
    swiglu_backend: str = _kernel_switch("SwiGLU activation", "fused kernels")
    rmsnorm_backend: str = _kernel_switch("RMSNorm (and the residual add before it)", "one kernel each way")
    rope_backend: str = _kernel_switch(
        "QKV split + rotary embedding", "one kernel each way", auto_also=" and the head dim is a power of two"
    )
    cross_entropy_backend: str = _kernel_switch(
        "the loss (tensor parallelism has its own)",
        "one kernel each way, no fp32 logits",
        "its cross-entropy, fused by --compile",
    )
    device: str = _f("auto", "cpu (gloo) or cuda (NCCL); auto: cuda when available", ("auto", "cpu", "cuda"))
    save: str | None = _f(None, "checkpoint directory to save into")
    load: str | None = _f(None, "checkpoint directory (or DIR/step-N) to resume from")
    finetune: bool = _f(False, "with --load: weights only, fresh optimizer and step count")
    save_interval: int = _f(
        0, "steps between checkpoints (0: only at the end when --save is set)", allowed=at_least(0, "0: at the end")
    )
    keep_last: int = _f(0, "keep only the newest K checkpoints (0: keep all)", allowed=at_least(0, "0: keep all"))
    async_save: bool = _f(
        False,
        "write checkpoints in a background thread while training goes on (published at the next save or at the end)",
    )
    eval_interval: int = _f(0, "steps between evaluations (0: only at the end)", allowed=at_least(0, "0: at the end"))
    eval_iters: int = _f(4, "batches per evaluation", allowed=at_least(1))
    log_interval: int = _f(1, "steps between metric records", allowed=at_least(1))
    metrics_file: str | None = _f(None, "JSON-lines metrics file")
    progress: bool = _f(
        True, "show a progress bar on a terminal (--no-progress, or output not to a terminal: a line per logged step)"
    )
    # Watching a run (logging_sinks.py, evaluation.py)
    eval_metrics: list[str] = _f(
        ["loss", "perplexity", "accuracy"],
        "evaluation metrics by name (llamatron.training.evaluation; MODULE:NAME imports MODULE first)",
    )
    eval_tasks: list[str] = _f(
        [],
        "lm-evaluation-harness tasks (names or globs) run at every evaluation, logged as TASK/METRIC; needs "
        "--tokenizer and the eval extra (pip install 'llamatron[eval]'); refused under --tp, --pp, --cp, --ep",
    )
    eval_include_path: str | None = _f(None, "with --eval-tasks: a directory of task YAML files beside lm-eval's own")
    eval_limit: int | None = _f(None, "with --eval-tasks: examples per task (default: all)", allowed=at_least(1))
    tensorboard_dir: str | None = _f(None, "write TensorBoard event files of the metric records here")
    wandb_project: str | None = _f(None, "log the metric records to this Weights & Biases project")
    wandb_mode: str | None = _f(
        None,
        "W&B mode (offline: no network, upload later with `wandb sync`; default: "
        "W&B's own setting, $WANDB_MODE, else online)",
        ("online", "offline", "disabled"),
    )
    wandb_name: str | None = _f(None, "W&B run name (None: W&B generates one)")
    # Faults (faults.py)
    max_skipped_steps: int = _f(
        10,
        "stop after this many consecutive steps with a non-finite loss or gradient "
        "norm (each is skipped; 0: never stop)",
        allowed=at_least(0, "0: never stop"),
    )
    exit_duration_mins: float | None = _f(
        None,
        "save and exit cleanly once this many minutes have passed since "
        "start (set below the job's time limit, leaving time to save)",
        allowed=above(0, "minutes"),
    )
    dist_timeout: float = _f(
        1800.0,
        "seconds a collective may wait before failing with the ranks it waited for (checkpoint saves must fit in it)",
        allowed=above(0, "seconds"),
    )


@dataclass
class LoraConfig:
    """Parameter-efficient fine-tuning (adapters/): the model frozen, low-rank adapters trained."""

    lora_rank: int = _f(0, "LoRA rank r (0: no LoRA, train every weight)", allowed=at_least(0, "0: off"))
    lora_alpha: float = _f(
        16.0, "LoRA alpha: the update is alpha / rank times B A (PEFT's lora_alpha)", allowed=above(0)
    )
    lora_dropout: float = _f(
        0.0, "dropout on the adapters' input", allowed=Range(low=0.0, high=1.0, high_open=True, note="a probability")
    )
    lora_targets: list[str] = _f(
        ["all-linear"],
        "the decoder linears to adapt, by Hugging Face module name (q_proj, query_key_value, ...) or without _proj "
        "(q, k, v, o, gate, up, down); all-linear: every one",
    )
    lora_init_from: str | None = _f(
        None,
        "start the adapters from this PEFT adapter directory (adapter_config.json, adapter_model.safetensors) "
        "instead of PEFT's initialisation; its rank, alpha and targets must be the run's",
    )
    base_precision: str = _f("same", "LoRA's frozen base: same (as --precision) or nf4 (QLoRA)", ("same", "nf4"))


SECTIONS = {
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "lora": LoraConfig,
    "objective": ObjectiveConfig,
}


@dataclass
class RunConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    model_overrides: dict = field(default_factory=dict)  # YAML `model_overrides:` changes preset fields
    explicit: set = field(default_factory=set, repr=False)  # settings given by YAML or flags, not defaulted
    # model_overrides fields a command-line flag gave: field -> the flag as typed (--num-layers 4, Megatron-LM's
    # name; --model-override num_layers=4)
    override_flags: dict = field(default_factory=dict, repr=False)

    def model_config(self) -> ModelConfig:
        try:
            cfg = get_preset(self.train.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        names = [f.name for f in fields(cfg)]  # not hasattr: a property or method is no field
        for key in self.model_overrides:
            if key in names:
                continue
            owners = families_with_field(key)
            if owners:
                raise ConfigError(
                    f"model_overrides: {key} is an option of the {' and '.join(owners)} family's config, not of "
                    f"{self.train.model} ({cfg.family}): remove it, or choose a {owners[0]} model"
                )
            raise ConfigError(f"model_overrides: unknown model field {key!r}{did_you_mean(key, names)}")
        return cfg.with_changes(self.model_overrides) if self.model_overrides else cfg

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("explicit")
        out.pop("override_flags")
        return out

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(asdict(getattr(self, name)))
        return out


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(
        cls
    )  # evaluates every annotation's string: slow, and the planner asks thousands of times


def _field_type(f) -> type:
    t = _type_hints(SECTIONS_OWNER[f.name])[f.name]
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


SECTIONS_OWNER: dict[str, type] = {f.name: cls for cls in SECTIONS.values() for f in fields(cls)}
# Settings of several words that their flags take unquoted (_f(words=True))
WORD_SETTINGS = tuple(f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata.get("words"))


def add_config_arguments(parser: argparse.ArgumentParser, unlisted: frozenset[str] = frozenset()) -> None:
    """One flag per config field (and Megatron-LM's name for it, megatron_flags.py); defaults are suppressed so
    YAML values are not overridden by them. The fields in `unlisted` (settings a command does not use) still
    parse, so a train command line can be reused, but --help leaves them out."""
    unknown = unlisted - SECTIONS_OWNER.keys()
    if unknown:
        raise ValueError(f"unlisted settings {sorted(unknown)} are not config fields")
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, help="YAML file of settings (flag names with underscores)"
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            t = _field_type(f)
            default = (
                f.default
                if f.default is not MISSING
                else (f.default_factory() if f.default_factory is not MISSING else None)
            )
            help_text = f.metadata.get("help", "")
            if "(default:" not in help_text and default is not None:  # unset (None): the help says what happens
                help_text += f" (default: {default})"
            if f.name in unlisted:
                help_text = argparse.SUPPRESS
            if t is bool:
                group.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            elif typing.get_origin(t) is list:  # space-separated values: --eval-metrics loss accuracy
                group.add_argument(
                    flag,
                    nargs="+",
                    type=typing.get_args(t)[0],
                    default=argparse.SUPPRESS,
                    help=help_text,
                    metavar=f.name.upper(),
                )
            else:
                group.add_argument(
                    flag,
                    nargs="+" if f.metadata.get("words") else None,
                    type=t,
                    default=argparse.SUPPRESS,
                    choices=f.metadata.get("choices"),
                    help=help_text,
                    metavar=None if f.metadata.get("choices") else f.name.upper(),
                )

    add_model_override_argument(parser)
    add_model_aliases(parser)
    add_setting_aliases(parser)


def config_from_values(values: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from flat key/values (YAML keys or parsed flags)."""
    values = dict(values)
    overrides = values.pop("model_overrides", None) or {}
    if not isinstance(overrides, dict):
        raise ConfigError(
            f"model_overrides must be a mapping of model field: value (e.g. num_layers: 4), not {overrides!r}"
        )
    unknown = sorted(set(values) - set(SECTIONS_OWNER))
    if unknown:
        hints = "".join(did_you_mean(key, SECTIONS_OWNER) for key in unknown)
        raise ConfigError(f"unknown setting(s) {unknown}{hints}; see `llamatron train --help` for the names")
    cfg = RunConfig(model_overrides=dict(overrides), explicit=set(values) | ({"model"} if overrides else set()))
    for key, value in values.items():
        set_setting(cfg, key, _checked(key, value))
    return cfg


def set_setting(cfg: RunConfig, key: str, value: Any) -> None:
    """Setting `key` of `cfg` to `value` (a frozen section, the parallel layout, is replaced by its changed copy)."""
    section = section_of(key)
    setattr(cfg, section, dataclasses.replace(getattr(cfg, section), **{key: value}))


_FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
_NUMERIC = [(name, f) for name, cls in SECTIONS.items() for f in fields(cls) if _field_type(f) in (int, float)]
_UNRANGED = [f.name for _, f in _NUMERIC if "allowed" not in f.metadata]
if _UNRANGED:  # fails at import, so a new numeric setting cannot go unchecked
    raise TypeError(f"numeric settings {_UNRANGED} need a range: _f(..., allowed=...) (llamatron/config/ranges.py)")
# (section, field, flag, range, is an integer) of every numeric setting, for range_problems.
_RANGES: list[tuple[str, str, str, Range, bool]] = [
    (section_name, f.name, "--" + f.name.replace("_", "-"), f.metadata["allowed"], _field_type(f) is int)
    for section_name, f in _NUMERIC
]


def range_problems(cfg: RunConfig) -> list[str]:
    """Each numeric setting outside its declared range (unset ones, None, are left out)."""
    out = []
    for section_name, name, flag, allowed, integer in _RANGES:
        value = getattr(getattr(cfg, section_name), name)
        if value is not None and (why := problem(flag, value, allowed, integer)) is not None:
            out.append(why)
    return out


def _checked(key: str, value: Any) -> Any:
    """A setting's value with the checks its flag gets from argparse (type, choices): YAML skips argparse."""
    f, flag = _FIELDS[key], "--" + key.replace("_", "-")
    if value is None:
        if f.default is None:
            return None
        raise ConfigError(f"setting {key} ({flag}) is empty; give a value or remove it to use the default")
    t, choices = _field_type(f), f.metadata.get("choices")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if t in (int, float) and isinstance(value, str):
        try:  # as argparse converts a flag's text; YAML reads `3e-4` (no dot) as text
            value, number = t(value), True
        except ValueError:
            pass
    if t is float and number:
        try:
            value = float(value)
        except OverflowError:  # a YAML integer of hundreds of digits
            raise ConfigError(f"setting {key} ({flag}): {value} is too large for a number") from None
    elif typing.get_origin(t) is list and isinstance(value, str):
        value = value.split()  # `eval_metrics: loss accuracy`, as on the command line
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(t, "a list of strings")
    if typing.get_origin(t) is list:  # and each item of its type: eval_metrics: [1, 2] is no list of names
        ok = isinstance(value, list) and all(isinstance(v, typing.get_args(t)[0]) for v in value)
    else:
        ok = {
            bool: isinstance(value, bool),
            int: number and isinstance(value, int),
            float: isinstance(value, float),
            str: isinstance(value, str),
        }[t]
    if not ok:
        raise ConfigError(f"setting {key} ({flag}): {value!r} is not {kind}")
    if isinstance(value, str) and "\x00" in value:  # YAML can hold one; no path or name can (argv cannot)
        raise ConfigError(f"setting {key} ({flag}): {value!r} holds a NUL character")
    if choices and value not in choices:
        raise ConfigError(f"setting {key} ({flag}): {value!r} is not one of {', '.join(choices)}")
    return value


def section_of(key: str) -> str:
    """The config section (parallel, optim, data, train) holding setting `key`."""
    owner = SECTIONS_OWNER[key]
    return next(name for name, cls in SECTIONS.items() if cls is owner)


def load_config(args: argparse.Namespace) -> RunConfig:
    """YAML file (if --config) then the flags given explicitly."""
    values: dict[str, Any] = {}
    given = vars(args).copy()
    aliased_settings, spelled = settings_from_aliases(given)  # Megatron-LM's --train-iters and the like
    given.update(aliased_settings)
    for name in WORD_SETTINGS:  # `--data 0.5 a 0.5 b` unquoted: one text, as quoted
        if isinstance(given.get(name), list):
            given[name] = " ".join(given[name])
    config_file = given.pop("config", None)
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8 YAML"
            ) from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error_line(f"config file {path}", e)) from None
        if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
            raise ConfigError(f"config file {path} must hold a mapping of setting: value (names as keys)")
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    shape = model_overrides_from_flags(given)  # Megatron-LM's --num-layers and the like
    aliased = {field: f"{flag} {shape[field]}" for flag, field in MODEL_ALIASES.items() if field in shape}
    flagged = parse_model_overrides(given.pop("model_override", None))  # --model-override FIELD=VALUE
    from_file = values.get("model_overrides") or {}
    if (shape or flagged.values) and isinstance(from_file, dict):  # not a mapping: config_from_values says so
        values["model_overrides"] = merged_overrides({**from_file, **shape}, aliased, flagged)
    values.update({k: v for k, v in given.items() if k in SECTIONS_OWNER})
    cfg = config_from_values(values)
    misread = alias_problems(spelled, cfg.parallel.tp, cfg.parallel.etp)
    if misread:
        raise ConfigError("; ".join(misread))
    cfg.override_flags = {**aliased, **flagged.flags}
    return cfg


@dataclass
class Derived:
    """Sizes that follow from the config and the world size."""

    layout: ParallelLayout  # the settings' layout on the world (its data-parallel size)
    grad_accum_steps: int  # micro-batches per data-parallel rank per step
    device: str
    dtype_name: str
    compile: bool  # --compile, defaulting to on for cuda

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp(self) -> int:
        return self.layout.dp
