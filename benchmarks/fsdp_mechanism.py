"""Issue 35's mechanism choice, measured: llamatron's --fsdp (parallel/fsdp.py) against torch's FSDP2 `fully_shard`
(one unit per decoder layer, the root holding the embedding, norm and head) and today's data parallelism, on the
same model, batch and world size.

Per variant, one JSON line: the step time (median of the timed steps, after warm-up) and the peak parameter
elements a rank held, sampled before and after every module's forward and before every linear's backward: every
live parameter storage plus the shards. Only the layout differs: llamatron's variants run its train_step (its
loss, AdamW, gradient norm); FSDP2's runs the same model with torch's AdamW and cross entropy, so its time is a
lower bound of what it would cost inside llamatron (no gradient-norm collective, no clipping).

usage: torchrun --nproc-per-node 2 benchmarks/fsdp_mechanism.py [--model llama-tiny] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn


def _sampler(model: nn.Module, extra: list[torch.Tensor]) -> list[int]:
    samples: list[int] = []

    def held(*_args) -> None:
        # (FSDP2's sharded parameters are DTensors, whose local tensors come in `extra`; a unit it has gathered
        # holds plain tensors)
        plain = [p for p in model.parameters() if not hasattr(p, "_local_tensor")]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in plain + extra}
        storages.pop(0, None)
        samples.append(sum(storages.values()))

    for m in model.modules():
        m.register_forward_pre_hook(held)
        m.register_forward_hook(held)
        if isinstance(m, nn.Linear):
            m.register_full_backward_pre_hook(held)
    return samples


def _llamatron(args, extra: dict) -> tuple[list[float], int, int]:
    from llamatron.config.settings import config_from_values
    from llamatron.data.batches import micro_batches_for_step
    from llamatron.data.mock import MockDataset
    from llamatron.parallel.mesh import build_mesh
    from llamatron.training.engine import build_engine, train_step
    from llamatron.training.validate import validate

    world, rank = dist.get_world_size(), dist.get_rank()
    values = {"model": args.model, "mock_data": True, "seq_length": args.seq, "device": args.device, **extra}
    values |= {"micro_batch_size": args.batch, "global_batch_size": args.batch * world, "precision": args.precision}
    cfg = config_from_values(values)
    engine = build_engine(cfg, validate(cfg, world, torch.cuda.is_available()), build_mesh())
    model = engine.chunks[0]
    samples = _sampler(model, [b.param_data for b in engine.buffers])
    data = MockDataset(256, args.seq, 0)
    times = []
    for step in range(args.steps):
        mbs = micro_batches_for_step(data, step * args.batch * world, args.batch * world, args.batch, world, rank)
        mbs = [{k: v.to(engine.device) for k, v in mb.items()} for mb in mbs]
        _sync(args)
        t = time.perf_counter()
        train_step(engine, mbs, step)
        for buf in engine.buffers:
            buf.finish_param_gather()
        _sync(args)
        times.append(time.perf_counter() - t)
    size = engine.buffers[0].param_data.element_size()
    return times, max(samples) // size, sum(p.numel() for p in model.parameters())


def _fsdp2(args) -> tuple[list[float], int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from llamatron.models import build_model, get_preset

    cfg = get_preset(args.model)
    model = build_model(cfg)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if args.device == "cuda":  # our loss is the global mean already: sum the gradients (PREMUL_SUM: not on gloo,
        model.set_gradient_divide_factor(1.0)  # where FSDP2 averages; the time is the same)
    model.to_empty(device=args.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    total = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    samples = _sampler(model, [p._local_tensor for p in model.parameters()])
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=args.device)
    times = []
    for _ in range(args.steps):
        _sync(args)
        t = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        _sync(args)
        times.append(time.perf_counter() - t)
    return times, max(samples) // (2 if args.precision == "bf16" else 4), total


def _sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    variants = {
        "dp": lambda: _llamatron(args, {}),
        "dp distributed optimizer": lambda: _llamatron(args, {"distributed_optimizer": True}),
        "llamatron --fsdp": lambda: _llamatron(args, {"fsdp": True}),
        "torch FSDP2": lambda: _fsdp2(args),
    }
    for name, run in variants.items():
        times, peak, total = run()
        if dist.get_rank() == 0:
            timed = times[args.warmup :]
            record = {"variant": name, "world": dist.get_world_size(), "model": args.model, "params": total}
            record |= {"step_ms": round(1000 * statistics.median(timed), 1), "peak_param_elements": peak}
            record["peak_over_model"] = round(peak / total, 3)
            print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
