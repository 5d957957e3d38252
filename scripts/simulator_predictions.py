"""Prints docs/simulator.md's prediction table: Llama 2 7B/70B, Llama 3 8B/70B, Llama 3.1 405B and
Mixtral 8x7B/8x22B on 8, 64,
512 and 2048 H100s, each at the best layout `llamatron plan` finds (the fastest of all that fit by the step
simulator), with the days and GPU-hours of training 1T tokens and what the row rests on that no run of ours
measured. Run it after changing the simulator or its calibration and paste the rows into the doc.

usage: python scripts/simulator_predictions.py   (about two minutes on two cores)
"""

from __future__ import annotations

import json
import subprocess
import sys

MODELS = [
    ("Llama 2 7B", "llama2-7b", 4096),
    ("Llama 2 70B", "llama2-70b", 4096),
    ("Llama 3 8B", "llama3-8b", 8192),
    ("Llama 3 70B", "llama3-70b", 8192),
    ("Llama 3.1 405B", "llama3.1-405b", 8192),
    ("Mixtral 8x7B", "mixtral-8x7b", 4096),
    ("Mixtral 8x22B", "mixtral-8x22b", 4096),
]
GPUS = (8, 64, 512, 2048)
BATCH_TOKENS = 4 * 1024 * 1024


def layout_text(lay: dict) -> str:
    pp = f"pp {lay['pp']}" + ("*" if lay["pp_layers"] else "") + (f" x vpp {lay['vpp']}" if lay["vpp"] > 1 else "")
    parts = [f"tp {lay['tp']}", pp, f"dp {lay['dp']}"]
    parts += [f"{k} {lay[k]}" for k in ("cp", "ep") if lay[k] > 1]
    parts += [f"mb {lay['micro_batch_size']}", f"gbs {lay['global_batch_size']}"]
    if lay["fsdp"]:
        group, kept = lay["fsdp_shard_group"], lay["fsdp_keep_params"]
        parts.append("fsdp" + (f" over {group}" if group else "") + (", params kept" if kept else ""))
    elif lay["distributed_optimizer"]:
        parts.append("dist-opt")
    if lay["recompute"] != "none":
        layers = lay["recompute_layers"]
        parts.append(f"recompute {lay['recompute']}" + (f":{layers}" if layers is not None else ""))
    return ", ".join(parts)


def unmeasured(lay: dict, gpus: int) -> str:
    """What the row's prediction rests on that no run of ours measured (docs/simulator.md, What these assume)."""
    rests = ["network"] if gpus > 8 else []  # NIC efficiency 0.85 of line rate, no multi-node run
    rests += [f"tp {lay['tp']}"] if lay["tp"] > 2 else []  # the 1.8x tp factor, fitted at tp 2
    rests += ["pipeline"] if lay["pp"] > 1 else []  # llamatron's schedules, no pp run on GPUs
    rests += ["cp"] if lay["cp"] > 1 else []
    rests += ["fsdp"] if lay["fsdp"] and gpus > 1 else []  # no multi-GPU --fsdp run
    rests += ["all-to-all, even loads"] if lay["ep"] > 1 else []  # NCCL's all-to-all at an assumed efficiency
    return ", ".join(rests) or "nothing"


def row(label: str, model: str, seq: int, gpus: int) -> str:
    command = [sys.executable, "-m", "llamatron", "plan", "--model", model, "--gpus", str(gpus), "--gpu", "h100-sxm"]
    command += ["--network", "8x400Gb-ndr", "--seq-length", str(seq), "--global-batch-size", str(BATCH_TOKENS // seq)]
    command += ["--top", "1", "--json", "--train-tokens", "1e12"]
    done = subprocess.run(command, capture_output=True, text=True)  # exit 1: no layout fits (still JSON)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command[1:])} failed: {done.stderr.strip()}")
    plan = json.loads(done.stdout)
    if not plan["layouts"]:
        needs = plan["explanation"].rsplit("needs at least ", 1)[-1].removesuffix(" of this size")
        why = f"does not fit (weights, gradients and optimizer state alone; needs at least {needs})"
        return f"| {label} | {seq} | {gpus} | {why} | | | | | | |"
    best = plan["layouts"][0]  # the fastest by the simulator
    sim = best["simulation"]
    return (
        f"| {label} | {seq} | {gpus} | {layout_text(best)} | {sim['tokens_per_sec_per_gpu']:,.0f} | "
        f"{sim['mfu']:.1%} | {sim['train']['days']:.1f} | {sim['train']['gpu_hours']:,.0f} | "
        f"{best['memory_gb']['total']:.1f} | {unmeasured(best, gpus)} |"
    )


def main() -> None:
    print(
        "| model | seq | GPUs | best layout (simulated) | tokens/s/GPU | MFU | days for 1T tokens | GPU-hours for 1T "
        "tokens | memory/GPU GB | rests on, unmeasured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, model, seq in MODELS:
        for gpus in GPUS:
            print(row(label, model, seq, gpus), flush=True)


if __name__ == "__main__":
    main()
