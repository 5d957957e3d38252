"""torchtitan 0.3.0's own DeepSeek-V3 model and Trainer on Moonlight-16B-A3B's shape, cut to --layers layers: the
peer row beside `llamatron bench --model moonlight-16b-a3b --model-override num_layers=N` (issue 49).

Built the way ../shared/peers/titan_bench.py builds torchtitan's Llama 3 (its Trainer, FSDP2 on one GPU, bf16
parameters with fp32 reduce, fused AdamW, grad clipping 1.0, its MoE with grouped GEMMs and its load-balancing bias
hook, per-block compile with --compile), with its helpers (`common`: shims' targets, results file) read from the
peers folder (PEERS_DIR, default .peers — copy ../shared/peers there as its README says). Only the tokenizer and a
random-token loader are ours. The shape is Moonlight's config.json: hidden 2048, 16 heads, no low-rank query,
kv_lora_rank 512, qk 128 + 64 rotary, v 128, rope theta 50000 without scaling, one dense layer of 11264, then MoE
layers of 64 experts of 1408, top 6, sigmoid scores renormalised and scaled by 2.446, 2 shared experts, vocab 163840;
--mtp N adds N multi-token-prediction layers (torchtitan's MTPLoss, weight 0.3 there; the dataloader then emits
positions, which it needs). Attention: torchtitan's ScaledDotProductAttention (its FlexAttention fails on torch 2.11,
as titan_bench.py notes).

  torchrun --standalone --nproc_per_node=1 benchmarks/titan_deepseek_bench.py --layers 4 --mb 1 --global-batch 4 \
      --compile [--mtp 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass

sys.path.insert(0, os.environ.get("PEERS_DIR", os.path.join(os.getcwd(), ".peers")))
import common  # noqa: E402
import torch  # noqa: E402

MOONLIGHT = dict(
    vocab=163840, dim=2048, heads=16, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_dim=128, rope_theta=50000.0,
    dense_ffn=11264, moe_ffn=1408, experts=64, shared=2, top_k=6, route_scale=2.446,
)  # fmt: skip


def _shims() -> list[str]:
    """torch 2.11 lacks two names torchtitan 0.3.0 imports or calls (as in titan_bench.py)."""
    shims = []
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None
        shims.append("torch.distributed.set_timeout no-op")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        shims.append("torch.distributed.fsdp.DataParallelMeshDims placeholder")
    return shims


def _model_config(args):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
    )

    s = MOONLIGHT
    rope = ComplexRoPE.Config(dim=s["qk_rope"], max_seq_len=args.seq, theta=s["rope_theta"], scaling="none")
    layers = _build_dsv3_layers(
        n_layers=args.layers, n_dense_layers=1, dim=s["dim"], n_heads=s["heads"], q_lora_rank=0,
        kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope"], qk_rope_head_dim=s["qk_rope"],
        v_head_dim=s["v_dim"], mscale=1.0, dense_hidden_dim=s["dense_ffn"], moe_hidden_dim=s["moe_ffn"],
        num_experts=s["experts"], num_shared_experts=s["shared"], router_top_k=s["top_k"],
        router_score_func="sigmoid", router_route_scale=s["route_scale"], router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    cfg = DeepSeekV3Model.Config(
        vocab_size=s["vocab"],
        dim=s["dim"],
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"], param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s["dim"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"], param_init=_output_linear_init(s["dim"])),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=s["dim"], num_mtp_layers=args.mtp),
    )
    swapped = 0
    for _fqn, _cfg, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        if isinstance(attr, int):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
        swapped += 1
    print(f"swapped {swapped} FlexAttention configs for ScaledDotProductAttention", flush=True)
    return cfg


def _trainer_config(args):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw, register_moe_load_balancing_hook
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.deepseek_v3 import MTPLoss, parallelize_deepseekv3
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    vocab, seq = MOONLIGHT["vocab"], args.seq

    class RandomTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = vocab

        def __init__(self, config, **kwargs):
            super().__init__()
            self.vocab_size, self.eos_id, self.bos_id, self.pad_id = config.vocab_size, 2, 1, None

        def encode(self, *a, **k):
            return [1, 2]

        def decode(self, *a, **k):
            return ""

        def get_vocab_size(self):
            return self.vocab_size

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            positions: bool = False

        def __init__(self, config, *, dp_rank=0, local_batch_size=1, **kwargs):
            self.positions, self.batch = config.positions, local_batch_size
            self.generator = torch.Generator().manual_seed(1234 + dp_rank)

        def __iter__(self):
            pos = torch.arange(seq).expand(self.batch, -1).contiguous()
            while True:
                x = torch.randint(0, vocab, (self.batch, seq + 1), generator=self.generator)
                inputs = {"input": x[:, :-1].contiguous()} | ({"positions": pos} if self.positions else {})
                yield inputs, x[:, 1:].contiguous()

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    spec = ModelSpec(
        name="deepseek_v3", flavor=f"moonlight-{args.layers}l", model=_model_config(args),
        parallelize_fn=parallelize_deepseekv3, pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=None,
    )  # fmt: skip
    loss = MTPLoss.Config(global_vocab_size=vocab) if args.mtp else CrossEntropyLoss.Config(global_vocab_size=vocab)
    cfg = Trainer.Config(
        model_spec=spec,
        hf_assets_path="/nonexistent",
        dump_folder=os.environ.get("TITAN_DUMP", "/tmp/titan_dump"),
        tokenizer=RandomTokenizer.Config(),
        dataloader=RandomTokens.Config(positions=bool(args.mtp)),
        loss=loss,
        optimizer=default_adamw(lr=1e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(
            local_batch_size=args.mb,
            global_batch_size=args.global_batch,
            seq_len=seq,
            steps=args.warmup + args.steps,
            max_norm=1.0,
            disable_cuda_graphs=True,
            dtype="float32",
            mixed_precision_param="bfloat16",
        ),  # fmt: skip
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=None,
        compile=CompileConfig(enable=args.compile, components=["model", "loss"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=1234),
    )
    return Trainer, cfg


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mb", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--mtp", type=int, default=0, help="multi-token-prediction layers")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    base = dict(stack="torchtitan deepseek_v3" + (" +compile" if args.compile else " eager"), model="moonlight",
                layers=args.layers, seq=args.seq, micro_batch=args.mb, global_batch=args.global_batch, mtp=args.mtp,
                env=common.env_summary())  # fmt: skip
    base["shims"] = _shims()
    try:
        Trainer, cfg = _trainer_config(args)
        times: list[float] = []

        class TimedTrainer(Trainer):
            def train_step(self, data_iterator):
                torch.cuda.synchronize()
                start = time.perf_counter()
                super().train_step(data_iterator)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                print(f"  step {len(times) - 1:2d} {times[-1] * 1e3:9.1f} ms", flush=True)

        trainer = TimedTrainer(cfg)
        params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        trainer.metrics_processor.device_memory_monitor.reset_peak_stats = lambda: None  # peak over every step
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        timed = times[args.warmup :]
        step = sum(timed) / len(timed)
        rec = base | dict(
            status="ok", params=params, step_times=timed, step_s_mean=step,
            tokens_per_s=args.global_batch * args.seq / step,
            peak_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
        )  # fmt: skip
        common.write_result(rec)
        trainer.close()
    except Exception as e:  # noqa: BLE001 - a measuring instrument: the failure is its record
        traceback.print_exc()
        common.write_result(base | dict(status="failed", error=f"{type(e).__name__}: {e}"[:2000]))
        sys.stdout.flush()
        os._exit(1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
