"""Throughput, FLOPs, MFU, memory, and the sinks metric records go to (console, JSON lines)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

# Dense bf16 peak per GPU, by name fragment (datasheet figures, as docs/design.md specifies).
_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device: torch.device | str) -> float | None:
    """Datasheet dense bf16 peak of this GPU, or None when unknown (MFU is then reported as null)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_gib(device: torch.device | str) -> float:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    except ImportError:  # pragma: no cover - non-POSIX
        return float("nan")


def throughput(
    tokens: int, seconds: float, flops_per_token: float, num_gpus: int, peak: float | None
) -> dict[str, Any]:
    """tokens/s per GPU, TFLOP/s per GPU and MFU for `tokens` trained by `num_gpus` in `seconds`."""
    tps = tokens / seconds / num_gpus
    tflops = tps * flops_per_token / 1e12
    return {"tokens_per_sec": tps, "tflops_per_gpu": tflops, "mfu": (tflops / peak) if peak else None}


class MetricsSink:
    """Writes each record to the JSON-lines file and any other registered sink."""

    def __init__(self, path: str | None, extra_sinks: list | None = None):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)
        self.extra_sinks = extra_sinks or []

    def write(self, record: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) and k == "mfu" else v) for k, v in record.items()
        }
        if self.file is not None:
            self.file.write(json.dumps(clean) + "\n")
        for sink in self.extra_sinks:
            sink(clean)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        for sink in self.extra_sinks:  # TensorBoard / W&B flush and finish their runs
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (host clocks around GPU work need it); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.start = time.perf_counter()

    def elapsed(self, sync: bool = True) -> float:
        if sync:
            sync_device(self.device)
        return time.perf_counter() - self.start

    def reset(self) -> None:
        self.start = time.perf_counter()
