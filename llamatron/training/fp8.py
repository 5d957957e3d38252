"""FP8 training (--fp8): the decoder's linear layers run FP8 matmuls through torchao.float8.

What runs in FP8: each decoder layer's QKV, attention output (DeepSeek-V3's five latent-attention projections),
gate/up and down projections (Falcon's too),
forward and backward, with dynamic scaling (torchao's recipes: `tensorwise` scales each tensor by its own amax;
`rowwise` scales each row, with the weight gradient's matmul in higher precision). The embedding, the output
head, norms, attention and the loss stay bf16; weights, gradients, master weights and optimizer state are what
they are without FP8 (bf16 / fp32), so checkpoints do not change and FP8 can be switched on or off at a resume.

Plain `nn.Linear` layers become torchao's `Float8Linear` (its public `convert_to_float8_training`; the module
keeps its parameters, so their names and specs stay). Tensor parallelism's `ColumnParallelLinear` and
`RowParallelLinear` are not `nn.Linear`s: they get an `FP8Matmul` as their `linear` and run it on their local
shards. Under LoRA (adapters/lora.py) the frozen base's matmul runs FP8 (a `LoraLinear`'s `base_matmul`, a
`LoraMatmul`'s `inner`) and the adapters' small matmuls stay bf16. That is written here because torchao's
tensor-parallel support is for DTensor, which llamatron's layers do not use; it calls torchao's own FP8 matmul
(the autograd function `Float8Linear` runs), so the numerics are torchao's. A sharded layer scales its local
shard (tensorwise: its own amax), which is at least as precise.

A mixture of experts' routed experts are grouped GEMMs, not linears: with `experts` (--fp8-experts) they get an
`FP8GroupedMM` (fp8_experts.py: torchao's MoE FP8 rowwise recipe) as their `grouped_mm`. Off by default: on an H200
mixtral-1b's step was 0.95x of bf16's, and 1.21x at most with the quantisation free (RESULTS.md run 23); 2,000
steps on real text ended 0.24% above bf16's validation loss.
The router stays bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging

import torch
from torch import nn

from ..adapters.lora import LoraLinear, LoraMatmul
from ..models.config import ModelConfig
from ..models.inventory import layers
from ..models.moe import Experts
from ..models.transformer import Transformer
from ..parallel.tensor import padded_vocab_size, shard_numel
from ..parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear
from .fp8_experts import FP8GroupedMM

# H100/H200 (9.0), L4/L40S/RTX 4090 (8.9), Blackwell (10.0+) have FP8 tensor cores.
FP8_MIN_CAPABILITY = (8, 9)
FP8_MULTIPLE = 16  # torch._scaled_mm takes dimensions that are multiples of 16
# torch._scaled_grouped_mm (the experts' FP8 GEMMs) runs on these alone: H100/H200 (9.0), B200 (10.0)
FP8_GROUPED_CAPABILITIES = ((9, 0), (10, 0))


def torchao_missing() -> bool:
    return importlib.util.find_spec("torchao") is None


def fp8_flag_problems(
    recipe: str, model: ModelConfig, emulate: bool = False, head: bool = False, experts: bool = False
) -> list[str]:
    """The FP8 flags against each other and the model, nothing about the machine (what `plan` checks too)."""
    if recipe == "none":
        flags = [f for f, on in (("--fp8-emulate", emulate), ("--fp8-head", head), ("--fp8-experts", experts)) if on]
        verb = "needs" if len(flags) == 1 else "need"
        return [f"{' and '.join(flags)} {verb} --fp8 tensorwise or rowwise"] if flags else []
    if experts and not model.is_moe:
        return ["--fp8-experts is for a mixture of experts' grouped GEMMs; this model has no experts: drop it"]
    return []


def fp8_problems(
    recipe: str,
    emulate: bool,
    device: str,
    dtype_name: str,
    model: ModelConfig,
    tp: int,
    tokens_per_matmul: int,
    capability: tuple[int, int] | None = None,
    head: bool = False,
    experts: bool = False,
) -> list[str]:
    """Why --fp8 `recipe` (with the output head when `head`, a MoE's experts when `experts`) cannot train this
    model here (empty: it can).
    `tokens_per_matmul` is the rows of one micro-batch's activations on a rank (micro-batch x sequence / context
    parallel size); `capability` is the GPU's (read from the device when None and the device is cuda)."""
    flag_problems = fp8_flag_problems(recipe, model, emulate, head, experts)
    if flag_problems or recipe == "none":
        return flag_problems
    if torchao_missing():
        return [f"--fp8 {recipe} needs torchao: pip install -e '.[fp8]' (or pip install 'torchao>=0.18,<0.19')"]
    problems = []
    # Emulated, FP8's quantisation also runs on top of fp32: the layout tests' precision (tests/layout.py)
    if dtype_name != "bf16" and not (emulate and dtype_name == "fp32"):
        problems.append(
            f"--fp8 runs on top of bf16, not {dtype_name}: use --precision bf16 (or auto on a GPU; "
            "fp32 only with --fp8-emulate)"
        )
    if not emulate:
        if device != "cuda":
            problems.append(
                f"--fp8 {recipe} needs an NVIDIA GPU with FP8 tensor cores (H100, H200, L40S, RTX 4090, or newer); "
                f"this run is on {device} (--fp8-emulate runs FP8's numerics without them, slowly: for tests)"
            )
        else:
            major, minor = capability or torch.cuda.get_device_capability()
            if (major, minor) < FP8_MIN_CAPABILITY:
                problems.append(
                    f"--fp8 {recipe} needs FP8 tensor cores (compute capability 8.9 or newer: H100, H200, L40S); "
                    f"this GPU is {major}.{minor}: use --fp8 none"
                )
            elif model.num_experts and experts and (major, minor) not in FP8_GROUPED_CAPABILITIES:
                problems.append(
                    f"--fp8 {recipe} on a mixture of experts runs its experts' grouped GEMMs in FP8, which "
                    f"torch._scaled_grouped_mm does on compute capability 9.0 or 10.0 only (H100, H200, B200); this "
                    f"GPU is {major}.{minor}: leave out --fp8-experts to keep the experts in bf16"
                )
    problems += _shape_problems(model, tp, tokens_per_matmul, head)
    return problems


def _shape_problems(model: ModelConfig, tp: int, tokens: int, head: bool) -> list[str]:
    """Every FP8 matmul's dimensions on a rank must be multiples of 16: features in and out, and the tokens
    (the inner dimension of the weight gradient's matmul)."""
    sizes = {
        "hidden_size": model.hidden_size,
        **_attention_sizes(model, tp),
        "ffn_hidden_size per rank": model.ffn_hidden_size // tp,
        "tokens per micro-batch and rank (micro-batch-size x seq-length / cp)": tokens,
    }
    if model.shared_expert_ffn:  # its linears run FP8 like the dense MLP's
        sizes["shared_expert_ffn per rank"] = model.shared_expert_ffn // tp
    if head:
        # tensor parallelism pads the vocabulary to a multiple of 128 per rank; one process does not
        vocab = padded_vocab_size(model.vocab_size, tp) // tp if tp > 1 else model.vocab_size
        sizes["--fp8-head: the vocabulary per rank"] = vocab
    bad = [f"{name} = {size}" for name, size in sizes.items() if size % FP8_MULTIPLE]
    if not bad:
        return []
    return [
        f"--fp8 needs every matmul dimension to be a multiple of {FP8_MULTIPLE}; not so: {', '.join(bad)} "
        "(change the shape or the layout, or use --fp8 none)"
    ]


def _attention_sizes(model: ModelConfig, tp: int) -> dict[str, int]:
    """Each attention linear's inputs and outputs on a rank, read from the layers' own weights and their split
    (models/inventory.py): the shared attention's QKV and output projections, latent attention's five."""
    sizes = {}
    for layer in dict.fromkeys(layers(model)):
        for w in layer.weights:
            if w.kind != "matmul" or not w.name.startswith("attn.") or len(w.shape) != 2:
                continue
            out, inputs = w.shape
            local = shard_numel(w.split, w.shape, model, tp)
            out, inputs = (out, local // out) if w.split == "row" else (local // inputs, inputs)
            linear = w.name.removesuffix(".weight")
            sizes[f"{linear} outputs per rank"] = out
            sizes[f"{linear} inputs per rank"] = inputs
    return sizes


@functools.cache
def _import_torchao(module: str = "torchao.float8") -> None:
    """Import torchao's `module` once, without its import-time warnings: on a build without its CUDA extensions
    (CPU, emulation) it warns about each one it cannot load, and about Enums it registers with torch's pytree."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        importlib.import_module(module)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def float8_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig for a recipe name (emulate: FP8 numerics without FP8 hardware)."""
    _import_torchao()
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


class FP8Matmul:
    """x W^T (+ b) with torchao's FP8 matmul and scaling, for layers that are not nn.Linear (tensor parallel)."""

    def __init__(self, recipe: str, emulate: bool):
        _import_torchao()
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.recipe, self.config = recipe, float8_config(recipe, emulate)
        self._matmul = matmul_with_hp_or_float8_args
        c = self.config
        # The output, input-gradient and weight-gradient matmuls, as torchao's Float8Linear configures them.
        gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        configs = [ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in gemms]
        self.mm_config = LinearMMConfig(*configs)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._matmul.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)

    def __repr__(self) -> str:
        return f"FP8Matmul({self.recipe})"


def _runs_fp8(module: nn.Module) -> bool:
    if type(module).__name__ == "Float8Linear":
        return True
    if isinstance(module, LoraLinear):
        return isinstance(module.base_matmul, FP8Matmul)
    if isinstance(module, Experts):
        return isinstance(module.grouped_mm, FP8GroupedMM)
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        inner = module.linear.inner if isinstance(module.linear, LoraMatmul) else module.linear
        return isinstance(inner, FP8Matmul)
    return False


def _decoder_linear(module: nn.Module, name: str) -> bool:
    """The linears torchao converts: those inside decoder layers (not the head), exactly nn.Linear; not a MoE
    router (num_experts outputs, a small matmul whose logits pick the experts: kept in bf16), nor a shared expert's
    gate (one output). A MoE layer's experts are grouped GEMMs, not linears: apply_fp8 gives them their own."""
    return type(module) is nn.Linear and name.startswith("layers.") and not name.endswith((".router", ".shared.gate"))


def apply_fp8(
    model: nn.Module, recipe: str, emulate: bool = False, head: bool = False, experts: bool = False
) -> list[str]:
    """Make `model`'s (a Transformer or a pipeline chunk) decoder linears run FP8, its output head with `head` and
    its MoE experts' grouped GEMMs with `experts`; returns their names ("head" for the head). Works on the meta
    model (parameters are kept, not copied), before or after tensor and expert parallelism."""
    if recipe == "none":
        return []
    _import_torchao()
    from torchao.float8 import convert_to_float8_training

    matmul = FP8Matmul(recipe, emulate)
    if head and isinstance(model, Transformer) and model.is_last_stage:  # a stage with the head
        model.head_matmul = matmul
    for name, module in model.named_modules():
        if not name.startswith("layers."):
            continue
        if isinstance(module, Experts) and experts:
            if not emulate:
                _import_torchao("torchao.prototype.moe_training")  # fp8_experts calls it
            module.grouped_mm = FP8GroupedMM(emulate)
        elif isinstance(module, LoraLinear):  # LoRA: the frozen part in FP8, the adapters in bf16
            module.base_matmul = matmul
        elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
            if isinstance(module.linear, LoraMatmul):
                module.linear.inner = matmul
            else:
                module.linear = matmul
    convert_to_float8_training(model, module_filter_fn=_decoder_linear, config=float8_config(recipe, emulate))
    return fp8_layers(model)


def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the layers of `model` that run FP8 matmuls (after apply_fp8), in the model's order."""
    names = [name for name, module in model.named_modules() if _runs_fp8(module)]
    fp8_head = isinstance(model, Transformer) and isinstance(model.head_matmul, FP8Matmul)
    return names + ["head"] if fp8_head else names
