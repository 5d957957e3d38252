"""megatron-core 0.19.2 mixture-of-experts training-step benchmark, without Transformer Engine or Apex.

The peer of `llamatron bench --model mixtral-1b` (issue 20): the same Mixtral-shaped model trained by
megatron-core's GPTModel with its local layer spec, timed the same way as ../shared/peers/megatron_bench.py
times the dense shapes (whose SDPA core attention and helpers, .peers/common.py, it imports at run time).

Shape `mixtral-1b`: vocab 32000, hidden 2048, 16 layers, 32 heads / 8 KV heads, 8 SwiGLU experts of FFN 5632,
top-2, seq 4096, untied embeddings, RMSNorm eps 1e-5, rope theta 10000; `tiny` is for the CPU smoke mode.

Training: bf16 parameters (Float16Module), megatron DistributedDataParallel with an fp32 grad buffer and the
distributed optimizer (fp32 main params and Adam states; torch AdamW(fused=True) in place of the TE/Apex
FusedAdam), get_forward_backward_func, --warmup untimed then --steps timed optimizer steps.

What megatron-core 0.19.2 offers without Transformer Engine (read in the wheel, megatron/core/...):
- Experts. `get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=...)` (models/gpt/gpt_layer_specs.py)
  builds the MoE spec with `LocalSpecProvider.grouped_mlp_modules` (models/backends.py), which returns
  SequentialMLP whatever moe_grouped_gemm says: the local spec has no grouped GEMM. SequentialMLP
  (transformer/moe/experts.py) runs one megatron MLP per expert in a Python loop over
  `torch.split(tokens, tokens_per_expert.tolist())`. The only training grouped-GEMM experts class is
  TEGroupedMLP, whose linear_fc1/linear_fc2 are TE's GroupedLinear (TEGroupedLinear in
  extensions/transformer_engine.py). The legacy GroupedMLP over the `grouped_gemm` pip package
  (a CUDA extension, no wheel for this machine) is gone from 0.19.2: nothing imports grouped_gemm.
  torch's grouped_mm appears only in InferenceGroupedMLP (experts.py), an inference path (its training
  forward is TEGroupedMLP's, TE again). So megatron-core's own expert path here is SequentialMLP:
  `--experts-impl sequential`, the default and the stack as shipped.
  `--experts-impl grouped-mm` is a stronger stand-in for what TE would give: megatron's own TEGroupedMLP
  (its permutation, fused weighted SwiGLU and probability weighting) with its two GroupedLinear
  submodules replaced by TorchGroupedLinear below, one torch._grouped_mm each way (grouped_mm where torch
  names it so). That class is this script's code, not megatron-core's; its rows say so.
- Dispatcher. At ep 1 and tp 1 both dispatchers move no data. `alltoall` (MoEAlltoAllTokenDispatcher,
  transformer/moe/token_dispatcher.py) permutes with a static output size (dropless: tokens x topk)
  and copies tokens-per-expert to the host on a side stream;
  `allgather` (MoEAllGatherTokenDispatcher) syncs on `.cpu()` and `.item()` first. Default alltoall.
- Router. TopKRouter (transformer/moe/router.py) -> topk_routing_with_score_function
  (transformer/moe/moe_utils.py). With moe_router_pre_softmax=False (the default) it takes the top-k
  logits and softmaxes over those k: exp(l_i) / sum_{j in top-k} exp(l_j), which is exactly Mixtral's
  softmax over all experts, top-k, renormalise (the top-k of logits and of their softmax are the same
  experts). pre_softmax=True would keep the unrenormalised softmax (DeepSeek style): not Mixtral.
  moe_router_load_balancing_type="aux_loss" with moe_aux_loss_coeff=0.02 is the Switch/GShard loss
  E * sum_i f_i * P_i (switch_load_balancing_loss_func) with P_i from the full softmax and
  f_i = tokens_i / (T * topk), each layer adding its own (a sum over layers); transformers' Mixtral loss
  is topk times that per layer (its f_i divides by T only) and taken over all layers' tokens at once, and
  llamatron averages over layers: the gradient's scale differs between the stacks, its cost does not.
  `--aux-loss seq_aux_loss` computes it per sequence (_apply_seq_aux_loss), as llamatron does.
  Logits in the parameter dtype (bf16) unless --router-dtype fp32; softmax in fp32 either way.
- Needs TE (left off): moe_permute_fusion (moe_utils.permute raises "fused_permute is not available"),
  moe_router_fusion (fused_topk_with_score_function), TE op-fuser grouped MLP, fused RoPE, fused
  softmax (Apex/TE), gradient_accumulation_fusion (Apex).

FLOPs and MFU on active parameters, llamatron's count (ModelConfig.flops_per_token): per token
6 * (N_active - input embedding) + 12 * L * h * S, N_active all parameters with only top-k experts per
layer (the router included); TFLOP/s = tokens/s * that, MFU = TFLOP/s / 989.

Run (one GPU; megatron-core from .peers-whl as ../shared/peers/run_suite.sh installs it):
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers-whl/*.whl
  PYTHONPATH=/tmp/site torchrun --standalone --nproc_per_node=1 benchmarks/megatron_moe_bench.py \
      --mbs 1,2,4 --global-batch 8
CPU smoke check of the API calls (numbers mean nothing; megatron-core unzipped from its wheel into /tmp/mcore):
  BENCH_CPU_SMOKE=1 PYTHONPATH=/tmp/mcore torchrun --standalone --nproc_per_node=1 \
      benchmarks/megatron_moe_bench.py --model tiny --mbs 1,2 --global-batch 4 --warmup 1 --steps 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import sys
import time
import traceback
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("PEERS_DIR") or os.path.join(_REPO, ".peers"))
import common  # noqa: E402  (.peers/common.py: SMOKE, timing loop, results writer)
import torch  # noqa: E402

FLOPS_FORMULA = (
    "flops_per_token = 6*(N_active - vocab*hidden) + 12*L*h*S; N_active = all params with top_k experts per "
    "layer (router included), input embedding excluded (lookup); mfu = tokens/s/GPU * flops_per_token / 989e12"
)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int  # each expert's SwiGLU width
    experts: int
    topk: int
    seq: int
    global_batch: int  # sequences per optimizer step

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def _params(self, experts: int) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + h * h  # qkv, out
        moe = experts * 3 * h * self.ffn + self.experts * h  # the experts counted, the (experts, h) router
        return self.layers * (attn + moe + 2 * h) + h + 2 * self.vocab * h  # norms; final norm; untied tables

    def n_params(self) -> int:
        """All parameters: every expert."""
        return self._params(self.experts)

    def active_params(self) -> int:
        """The parameters one token is computed with: top-k experts per layer, the router included."""
        return self._params(self.topk)

    def flops_per_token(self) -> float:
        return 6.0 * (self.active_params() - self.vocab * self.hidden) + 12.0 * self.layers * self.hidden * self.seq


SHAPES = {
    "mixtral-1b": MoEShape("mixtral-1b", 32000, 2048, 16, 32, 8, 5632, 8, 2, 4096, 8),
    # issue 34's fine-grained shape (RESULTS.md run 21): mixtral-1b with 64 experts of ffn 704, top 8
    "fine-grained": MoEShape("mixtral-1b-64x704-top8", 32000, 2048, 16, 32, 8, 704, 64, 8, 4096, 8),
    "tiny": MoEShape("tiny-moe", 1000, 128, 2, 4, 2, 352, 4, 2, 64, 4),  # CPU smoke mode only
}


class TorchGroupedLinear(torch.nn.Module):
    """All local experts' weights as one (experts, out, in) parameter, applied with one torch grouped_mm:
    a stand-in for TE's GroupedLinear inside megatron's TEGroupedMLP (ep 1, tp 1, no bias)."""

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config: Any,
        init_method: Any,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        pg_collection: Any,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if bias or pg_collection.expt_tp.size() > 1 or pg_collection.ep.size() > 1:
            raise ValueError("TorchGroupedLinear: bias, expert tensor or expert parallelism are not supported")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        weight = torch.empty(num_local_experts, output_size, input_size, dtype=config.params_dtype, device=device)
        for w in weight:  # each expert as megatron initialises one linear
            init_method(w)
        self.weight = torch.nn.Parameter(weight)
        self.weight.allreduce = True  # ep 1: the data-parallel group, as TE's expert linears at ep 1
        self._grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> tuple[torch.Tensor, None]:
        # from pinned memory without a host sync (TEGroupedMLP has already synced once for the list)
        ends = torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32, pin_memory=x.is_cuda)
        offsets = ends.to(x.device, non_blocking=True)
        return self._grouped_mm(x, self.weight.transpose(-2, -1), offs=offsets), None

    def backward_dw(self) -> None:  # weight grads are computed in backward (no delayed wgrad)
        pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="mixtral-1b")
    p.add_argument("--mbs", default="1,2,4", help="comma-separated micro-batch sizes, one row each")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the shape's, 4096)")
    p.add_argument(
        "--experts-impl",
        choices=["sequential", "grouped-mm"],
        default="sequential",
        help="sequential: megatron's SequentialMLP (its local spec's only expert path); grouped-mm: "
        "megatron's TEGroupedMLP over this script's torch grouped_mm linear",
    )
    p.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall")
    p.add_argument(
        "--router-dtype",
        choices=["param", "fp32"],
        default="param",
        help="router logits in the parameter dtype (bf16) or fp32 (moe_router_dtype)",
    )
    p.add_argument(
        "--aux-loss",
        choices=["aux_loss", "seq_aux_loss"],
        default="aux_loss",
        help="moe_router_load_balancing_type: over each micro-batch, or per sequence (as llamatron)",
    )
    p.add_argument("--recompute", choices=["none", "full"], default="none")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="profile one extra step: top kernels in the row")
    args = p.parse_args()
    shape = SHAPES[args.model]
    args.shape = dataclasses.replace(shape, global_batch=args.global_batch, seq=args.seq or shape.seq)
    args.mb_list = [int(x) for x in args.mbs.split(",")]
    bad = [mb for mb in args.mb_list if mb < 1 or args.global_batch % mb]
    if bad:
        p.error(f"--mbs {bad}: each micro-batch size must divide --global-batch {args.global_batch}")
    return args


def smoke_patch_streams() -> None:
    """CPU smoke mode: the CUDA stream and event calls of megatron's MoE dispatcher become no-ops."""

    class _Event:
        def synchronize(self) -> None:
            pass

        def record(self, *a: Any, **k: Any) -> None:
            pass

    class _Stream:
        def wait_stream(self, *a: Any, **k: Any) -> None:
            pass

        def wait_event(self, *a: Any, **k: Any) -> None:
            pass

        def record_event(self, *a: Any, **k: Any) -> _Event:
            return _Event()

        def synchronize(self) -> None:
            pass

    torch.cuda.Stream = lambda *a, **k: _Stream()  # type: ignore[assignment, misc]
    torch.cuda.Event = lambda *a, **k: _Event()  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]


def use_fused_adamw() -> None:
    """Without TE/Apex megatron builds torch.optim.AdamW; make it the fused kernel (the peer script does too)."""
    base = torch.optim.AdamW

    class FusedAdamW(base):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kw: Any) -> None:
            kw.pop("foreach", None)
            kw.setdefault("fused", not common.SMOKE)
            super().__init__(params, **kw)

    torch.optim.AdamW = FusedAdamW  # type: ignore[misc]  # looked up when megatron builds the optimizer


def setup() -> None:
    if common.SMOKE:
        common.smoke_patch_cuda()
        smoke_patch_streams()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend="gloo" if common.SMOKE else "nccl")
    if torch.distributed.get_world_size() != 1:
        raise SystemExit("megatron_moe_bench.py: one GPU only (ep 1, dp 1); run it with --nproc_per_node=1")
    use_fused_adamw()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if common.SMOKE:  # megatron's CUDA RNG bookkeeping on the CPU RNG
        import megatron.core.tensor_parallel.random as rng

        rng._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        rng._set_cuda_rng_state = lambda st, *a, **k: torch.set_rng_state(st)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(1234)


def transformer_config(shape: MoEShape, args: argparse.Namespace) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    recompute: dict[str, Any] = {}
    if args.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        init_method_std=0.02,
        attention_backend=AttnBackend.local,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=False,
        bias_activation_fusion=not common.SMOKE,  # megatron's torch.compile'd (weighted) SwiGLU
        bias_dropout_fusion=not common.SMOKE,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=common.SMOKE,
        # the mixture of experts: Mixtral's router (see the docstring), dropless, ep 1
        num_moe_experts=shape.experts,
        moe_ffn_hidden_size=shape.ffn,
        moe_router_topk=shape.topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_load_balancing_type=args.aux_loss,
        moe_aux_loss_coeff=0.02,
        moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=args.dispatcher,
        moe_router_dtype="fp32" if args.router_dtype == "fp32" else None,
        moe_grouped_gemm=args.experts_impl == "grouped-mm",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=1,
        **recompute,
    )


def layer_spec(args: argparse.Namespace) -> tuple[Any, str]:
    """The local MoE layer spec with SDPA core attention and the chosen experts; and the experts' description."""
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron_bench import make_sdpa_core_attention  # .peers: the dense peer's F.sdpa(is_causal) attention

    spec = get_gpt_layer_local_spec(num_experts=args.shape.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = make_sdpa_core_attention()
    moe_submodules = spec.submodules.mlp.keywords["submodules"]  # partial(MoELayer, submodules=MoESubmodules)
    if args.experts_impl == "grouped-mm":
        moe_submodules.experts = functools.partial(
            TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear)
        )
        desc = "megatron TEGroupedMLP with this script's TorchGroupedLinear (torch grouped_mm), not megatron code"
    else:
        desc = "megatron SequentialMLP (local spec: a loop over experts, one MLP each)"
    return spec, desc


def build(shape: MoEShape, args: argparse.Namespace) -> tuple[Any, Any, Any, dict]:
    """GPTModel -> Float16Module -> DDP (fp32 grads, distributed optimizer) and its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(shape, args)
    spec, experts_desc = layer_spec(args)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=10000,
    )
    real_params = sum(p.numel() for p in gpt.parameters())
    model = Float16Module(config, gpt)
    if not common.SMOKE:
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        min_lr=1e-5,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=False)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
    info = dict(
        experts=experts_desc,
        real_params=real_params,
        optimizer=f"{type(optimizer).__name__} over {type(inner).__name__} fused={inner.defaults.get('fused')}",
    )
    return model, optimizer, config, info


def make_step(model: Any, optimizer: Any, shape: MoEShape, mb: int) -> tuple[Any, list]:
    """One optimizer step over global_batch/mb micro-batches of fixed random tokens; the last step's losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    accum = shape.global_batch // mb
    g = torch.Generator(device=common.DEV)
    g.manual_seed(4321 + mb)
    pos = torch.arange(shape.seq, device=common.DEV).unsqueeze(0).expand(mb, -1).contiguous()
    batches = []
    for _ in range(accum):
        x = torch.randint(0, shape.vocab, (mb, shape.seq + 1), device=common.DEV, generator=g)
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous(), pos))
    it = itertools.cycle(batches)
    fwd_bwd = get_forward_backward_func()
    last: list = []

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        tokens, labels, position_ids = next(data_iterator)
        output = model(tokens, position_ids, None, labels=labels)  # per-token cross entropy [b, s]

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # megatron divides `loss` in place by accum

        return output, loss_func

    def step() -> None:
        get_moe_metrics_tracker().clear()  # the aux loss it sums per layer: this step's only
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=it,
            model=[model],
            num_microbatches=accum,
            seq_length=shape.seq,
            micro_batch_size=mb,
            decoder_seq_length=shape.seq,
            forward_only=False,
        )
        optimizer.step()
        last[:] = losses

    return step, last


def step_losses(last: list, shape: MoEShape, accum: int) -> dict:
    """The last timed step's LM loss and load-balancing loss (without its 0.02; ~1 when balanced), per layer mean."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    out = {"lm_loss": float(torch.stack([d["lm loss"] for d in last]).mean()) if last else None}
    metrics = get_moe_metrics_tracker().metrics
    entry = metrics.get("load_balancing_loss") or metrics.get("seq_load_balancing_loss")
    if entry is not None:
        out["load_balancing_loss"] = float(entry.values.sum()) / (shape.layers * accum)
    return out


def run_one(model: Any, optimizer: Any, shape: MoEShape, mb: int, args: argparse.Namespace, base: dict) -> None:
    accum = shape.global_batch // mb
    print(f"=== megatron-core-moe {shape.name} mb={mb} accum={accum} {args.experts_impl} {args.dispatcher}", flush=True)
    base = dict(base, micro_batch=mb, grad_accum=accum)
    try:
        step, last = make_step(model, optimizer, shape, mb)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        warm, times = common.time_steps(step, args.warmup, args.steps, torch.cuda.synchronize)
        wall = time.perf_counter() - t0
        peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        losses = step_losses(last, shape, accum)
        prof = common.kernel_profile(step) if args.profile else {}
        rec = common.summarize(
            shape,
            times,
            peak_alloc,
            peak_reserved,
            warmup_step_s=warm,
            bench_wall_s=wall,
            active_params=shape.active_params(),
            **losses,
            **base,
            **prof,
        )
        common.write_result(rec)
    except torch.cuda.OutOfMemoryError as e:
        print(f"OOM at mb={mb}: {str(e)[:300]}", flush=True)
        common.write_result(common.fail_record(shape, "OOM: " + str(e)[:600], **base))
    except Exception as e:  # noqa: BLE001  (a failed row is recorded; the next micro-batch size still runs)
        traceback.print_exc()
        common.write_result(common.fail_record(shape, e, **base))
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    shape: MoEShape = args.shape
    setup()
    import megatron.core

    print("env", common.env_summary(), "megatron.core", megatron.core.__version__, flush=True)
    t_build = time.perf_counter()
    model, optimizer, _, info = build(shape, args)
    print(
        f"built {shape.name}: {info['real_params']:,} params (formula {shape.n_params():,}; active "
        f"{shape.active_params():,}) in {time.perf_counter() - t_build:.1f}s; experts: {info['experts']}; "
        f"optimizer {info['optimizer']}",
        flush=True,
    )
    base = dict(
        stack="megatron-core-moe",
        megatron_core=megatron.core.__version__,
        global_batch=shape.global_batch,
        experts_impl=args.experts_impl,
        token_dispatcher=args.dispatcher,
        router_dtype=args.router_dtype,
        activation_checkpointing=args.recompute,
        compile=False,
        n_gpus=1,
        ep=1,
        flops_formula=FLOPS_FORMULA,
        attention="custom core_attention -> torch F.scaled_dot_product_attention(is_causal=True)",
        precision="bf16 params, fp32 grad buffer, fp32 main params + Adam states (DistributedOptimizer)",
        routing=f"softmax top-k renormalised (moe_router_pre_softmax=False), {args.aux_loss} 0.02, no z-loss, dropless",
        **info,
    )
    for mb in args.mb_list:
        run_one(model, optimizer, shape, mb, args, base)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
