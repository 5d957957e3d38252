"""Where a training step's GPU time goes, by kernel category, from torch.profiler.

    python benchmarks/profile_step.py --model llama-1b --seq-length 4096 --micro-batch-size 8 \
        --global-batch-size 8 --compile [--json]

Runs warm-up steps, then profiles `--steps` steps and prints the device time per category
(matmul, attention, communication, optimizer, other elementwise), the top kernels, and where the
device sat idle between kernels (`--gaps`: the kernel pairs around the idle time, largest total
first). `--sync-debug` then runs one more step with torch's CUDA sync debug mode and prints where the
host waited for the device (each synchronising call's Python stack). Any `llamatron train` flag is accepted. On CPU it profiles CPU operators instead (for
smoke tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from llamatron.config.settings import add_config_arguments, load_config  # noqa: E402
from llamatron.data.batches import (
    micro_batches_for_step,  # noqa: E402
    to_device,  # noqa: E402
)
from llamatron.data.mock import MockDataset  # noqa: E402
from llamatron.parallel.mesh import build_mesh, init_distributed  # noqa: E402
from llamatron.training.engine import build_engine, train_step  # noqa: E402
from llamatron.training.metrics import Timer, sync_device  # noqa: E402
from llamatron.training.validate import validate  # noqa: E402

# Kernel-name fragments per category, first match wins (lower-case).
CATEGORIES = [
    ("communication", ("nccl", "allreduce", "all_reduce", "reduce_scatter", "allgather", "all_gather")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "flex")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "addmm", "aten::mm", "aten::bmm", "linear")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "norm_kernel")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise/other"


def device_gaps(spans: list[tuple[str, float, float]], min_us: float = 2.0) -> list[tuple[float, str, str]]:
    """Idle stretches of the device: (length µs, kernel before, kernel after), longest first.

    spans: (name, start µs, end µs) of every kernel, on any stream; time covered by some kernel is busy, so
    kernels overlapping on two streams leave no gap. Stretches shorter than min_us are launch spacing.
    """
    gaps: list[tuple[float, str, str]] = []
    busy_until, last = None, ""
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        if busy_until is not None and start - busy_until >= min_us:
            gaps.append((start - busy_until, last, name))
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    return sorted(gaps, reverse=True)


def gaps_by_neighbours(gaps: list[tuple[float, str, str]], top: int) -> list[tuple[str, str, float, int]]:
    """(kernel before, kernel after, total µs, count) summed over equal neighbour pairs, largest total first."""
    total: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    for us, before, after in gaps:
        total[before, after] += us
        count[before, after] += 1
    return [(b, a, us, count[b, a]) for (b, a), us in sorted(total.items(), key=lambda kv: -kv[1])[:top]]


def engine_and_batch(args: argparse.Namespace, steps: int, model_overrides: dict | None = None) -> tuple:
    """The engine `llamatron train` would build from args (mock data), and step 0's micro-batches on its device;
    model_overrides are added to the config's (as YAML `model_overrides:` would)."""
    cfg = load_config(args)
    cfg.model_overrides.update(model_overrides or {})
    cfg.data.mock_data = True
    cfg.train.train_steps = steps
    derived = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available())
    init_distributed(derived.device)
    engine = build_engine(cfg, derived, build_mesh(cfg.parallel, cfg.parallel.dp_comm_max_ctas))
    t = cfg.train
    data = MockDataset(engine.model_cfg.vocab_size, cfg.data.seq_length, t.seed)
    batch = to_device(
        micro_batches_for_step(
            data, 0, t.global_batch_size, t.micro_batch_size, engine.mesh.layout.dp, engine.mesh.dp_rank
        ),
        engine.device,
    )
    return engine, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (default: 2)")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (default: 3)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed (default: 15)")
    parser.add_argument("--gaps", type=int, default=10, help="idle-time neighbour pairs listed (default: 10)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="after profiling, one step that reports each host-device synchronisation's stack",
    )
    args = parser.parse_args()
    engine, batch = engine_and_batch(args, args.warmup + 2 * args.steps + 1)
    for step in range(args.warmup):
        train_step(engine, batch, step)
    cuda = engine.device.type == "cuda"
    # Wall time of unprofiled steps: against the kernel time below it shows how long the GPU sat idle.
    sync_device(engine.device)
    timer = Timer(engine.device)
    for step in range(args.steps):
        train_step(engine, batch, args.warmup + step)
    wall_ms = 1000 * timer.elapsed() / args.steps
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        timer.reset()  # the profiled steps' own wall time: does profiling change how long a step takes?
        for step in range(args.steps):
            train_step(engine, batch, args.warmup + step)
        profiled_wall_ms = 1000 * timer.elapsed() / args.steps
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        us = evt.device_time_total if cuda else evt.self_cpu_time_total
        if us <= 0 or (not cuda and evt.key.startswith("ProfilerStep")):
            continue
        per_cat[category(evt.key)] += us
        per_kernel[evt.key] += us
        calls[evt.key] += evt.count
    total = sum(per_cat.values()) or 1.0
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "wall_ms_per_step": wall_ms,
        "profiled_wall_ms_per_step": profiled_wall_ms,
        "kernel_ms_per_step": sum(per_cat.values()) / 1000 / args.steps,
        "ms_per_step": {k: v / 1000 / args.steps for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "share": {k: v / total for k, v in per_cat.items()},
        "top_kernels": [
            (k[:160], v / 1000 / args.steps, calls[k] // args.steps)
            for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]
        ],
    }
    device = DeviceType.CUDA if cuda else DeviceType.CPU
    gaps = device_gaps(
        [
            (e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == device and not (not cuda and e.name.startswith("ProfilerStep"))
        ]
    )
    result["idle_ms_per_step"] = sum(us for us, _, _ in gaps) / 1000 / args.steps
    result["idle_gaps"] = [
        (b[:80], a[:80], us / 1000 / args.steps, n / args.steps) for b, a, us, n in gaps_by_neighbours(gaps, args.gaps)
    ]
    if engine.mesh.rank != 0:
        return
    if args.json:
        print(json.dumps(result))
        return
    idle = result["wall_ms_per_step"] - result["kernel_ms_per_step"]
    print(
        f"wall {result['wall_ms_per_step']:.1f} ms/step, kernels {result['kernel_ms_per_step']:.1f} ms/step "
        f"(device idle or overlapped: {idle:.1f} ms); the profiled steps' wall {profiled_wall_ms:.1f} ms/step"
    )
    print(f"{'category':<20} {'ms/step':>9} {'share':>7}")
    for k, ms in result["ms_per_step"].items():
        print(f"{k:<20} {ms:>9.1f} {result['share'][k]:>7.1%}")
    print("\ntop kernels (ms/step, calls/step):")
    for name, ms, n in result["top_kernels"]:
        print(f"  {ms:8.2f} {n:5d}  {name}")
    print(
        f"\ndevice idle between kernels inside the profiled steps: {result['idle_ms_per_step']:.2f} ms/step; "
        "largest by neighbours (ms/step, gaps/step, kernel before -> kernel after):"
    )
    for before, after, ms, n in result["idle_gaps"]:
        print(f"  {ms:8.2f} {n:6.1f}  {before} -> {after}")
    if args.sync_debug and cuda:
        stacks = synchronisations(lambda: train_step(engine, batch, args.warmup + 2 * args.steps))
        print(f"\nhost-device synchronisations in one step: {sum(stacks.values())}")
        for stack, n in stacks.items():
            print(f"  {n}x at\n" + stack)


def synchronisations(step) -> dict[str, int]:
    """Run `step` under torch.cuda's sync debug mode; count the distinct Python stacks that synchronised."""
    import traceback
    import warnings

    stacks: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # e.g. the mode's own "prototype feature" notice
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        text = "".join(traceback.format_list(frames[-8:]))
        stacks[f"{str(message)[:120]}\n{text}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()  # the check happens on the host at each call, so every sync has been seen when this returns
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return dict(stacks)


if __name__ == "__main__":
    main()
