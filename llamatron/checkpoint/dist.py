"""Checkpoints: save, resume, retention, atomic `latest`.

A checkpoint directory `DIR/step-N/` holds, by *global* parameter name and
full shape (so it does not depend on the layout that wrote it):
  model.safetensors      weights
  optimizer.safetensors  fp32 master weights (when separate) and AdamW moments, per parameter
  meta.json              step, consumed_samples, the resolved config, the model config, RNG states
It is written into `DIR/.tmp-step-N` and renamed into place; `DIR/latest` is
rewritten (atomically) only after that, so a crash mid-save leaves the previous
checkpoint and pointer intact.

This version gathers full tensors on one rank per pipeline stage; it is exact
for single-process runs and for data/tensor layouts whose shards can be
gathered (see `local_to_full`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError
from ..models import ModelConfig

MODEL_FILE, OPTIM_FILE, META_FILE = "model.safetensors", "optimizer.safetensors", "meta.json"


class CheckpointError(ValueError):
    pass


def _global_named_params(engine) -> list[tuple[str, torch.nn.Parameter]]:
    out = []
    for chunk in engine.chunks:
        names = getattr(chunk, "global_name", lambda n: n)
        for name, p in chunk.named_parameters():
            out.append((names(_plain_name(name)), p))
    return out


def _plain_name(name: str) -> str:
    """Parameter names without wrapper prefixes (recompute wraps layers as `.layer.`)."""
    return name.replace(".layer.", ".")


def local_to_full(param: torch.nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter from this rank's shard (tensor parallelism sets `gather_fn`)."""
    gather = getattr(param, "gather_fn", None)
    return gather(local) if gather is not None else local


def full_to_local(param: torch.nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    shard = getattr(param, "shard_fn", None)
    return shard(full) if shard is not None else full


def _optimizer_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter: full-size exp_avg / exp_avg_sq / master tensors assembled from this rank's segments."""
    opt = engine.optimizer
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, seg in enumerate(opt.segments):
        p = seg.param
        entry = state.setdefault(id(p), {k: torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                                         for k in ("exp_avg", "exp_avg_sq", "master")})
        n = seg.end - seg.start
        entry["exp_avg"][seg.param_offset:seg.param_offset + n] = opt.exp_avg[i]
        entry["exp_avg_sq"][seg.param_offset:seg.param_offset + n] = opt.exp_avg_sq[i]
        entry["master"][seg.param_offset:seg.param_offset + n] = opt.master[i]
        entry["step"] = opt.steps[i]
    if opt.distributed:
        from ..parallel.mesh import all_reduce

        for entry in state.values():  # segments of one parameter are disjoint across dp ranks
            for k in ("exp_avg", "exp_avg_sq", "master"):
                all_reduce(entry[k], engine.mesh.dp_group)
    return {str(k): v for k, v in state.items()}


def save_checkpoint(engine, root: str, step: int, consumed_samples: int) -> str:
    mesh = engine.mesh
    if mesh.tp > 1 or mesh.pp > 1:
        raise CheckpointError("saving under tensor or pipeline parallelism is not supported by this checkpoint "
                              "version yet; save with --tp 1 --pp 1 (data parallelism is supported)")
    named = _global_named_params(engine)
    opt_state = _optimizer_state(engine)
    root_path = Path(root)
    final = root_path / f"step-{step}"
    tmp = root_path / f".tmp-step-{step}"
    if mesh.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        weights = {name: local_to_full(p, p.detach()).contiguous().cpu() for name, p in named}
        save_file(weights, str(tmp / MODEL_FILE))
        optim = {}
        for name, p in named:
            st = opt_state[str(id(p))]
            for k in ("exp_avg", "exp_avg_sq", "master"):
                optim[f"{name}.{k}"] = st[k].view_as(p).cpu()
            optim[f"{name}.step"] = st["step"].reshape(1).cpu()
        save_file(optim, str(tmp / OPTIM_FILE))
        meta = {"step": step, "consumed_samples": consumed_samples, "config": engine.cfg.to_dict(),
                "model_config": engine.model_cfg.to_dict(), "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp},
                "master_is_param": engine.optimizer.master_is_param}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        torch.save(_rng_state(), tmp / "rng.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root_path, final.name)
        _apply_retention(root_path, engine.cfg.train.keep_last)
    _barrier()
    return str(final)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def _apply_retention(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted((int(p.name.split("-")[1]), p) for p in root.glob("step-*") if p.name.split("-")[1].isdigit())
    for _, path in steps[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint(path: str) -> Path:
    """DIR (follows DIR/latest) or DIR/step-N -> the step directory."""
    p = Path(path)
    if (p / META_FILE).is_file():
        return p
    latest = p / "latest"
    if latest.is_file():
        step_dir = p / latest.read_text().strip()
        if (step_dir / META_FILE).is_file():
            return step_dir
        raise CheckpointError(f"{latest} points to {step_dir}, which is not a complete checkpoint")
    raise CheckpointError(f"no checkpoint at {path}: expected {path}/latest or {path}/{META_FILE}")


def read_meta(path: str) -> dict[str, Any]:
    return json.loads((resolve_checkpoint(path) / META_FILE).read_text())


def read_model_config(path: str, requested: ModelConfig | None = None) -> ModelConfig:
    return ModelConfig.from_dict(read_meta(path)["model_config"])


def load_checkpoint(engine, path: str, weights_only: bool = False) -> dict[str, Any]:
    step_dir = resolve_checkpoint(path)
    meta = json.loads((step_dir / META_FILE).read_text())
    named = _global_named_params(engine)
    with safe_open(str(step_dir / MODEL_FILE), framework="pt") as f:
        keys = set(f.keys())
        problems = []
        for name, p in named:
            if name not in keys:
                problems.append(f"missing {name}")
                continue
            shape = tuple(f.get_slice(name).get_shape())
            want = tuple(getattr(p, "full_shape", p.shape))
            if shape != want:
                problems.append(f"{name}: checkpoint {shape} vs model {want}")
        extra = keys - {n for n, _ in named}
        if engine.mesh.pp == 1 and extra:
            problems += [f"unexpected {k}" for k in sorted(extra)[:10]]
        if problems:
            raise CheckpointError(f"checkpoint {step_dir} does not fit this model ({engine.cfg.train.model}):\n  "
                                  + "\n  ".join(problems[:40]))
        with torch.no_grad():
            for name, p in named:
                p.copy_(full_to_local(p, f.get_tensor(name).to(p.device)).to(p.dtype))
    opt = engine.optimizer
    if weights_only:
        with torch.no_grad():  # fresh optimizer: master weights start from the loaded weights
            for i, seg in enumerate(opt.segments):
                if not opt.master_is_param:
                    opt.master[i].copy_(seg.buffer.param_data[seg.start:seg.end])
        return meta
    name_of = {id(p): n for n, p in named}
    with safe_open(str(step_dir / OPTIM_FILE), framework="pt") as f, torch.no_grad():
        for i, seg in enumerate(opt.segments):
            name, p = name_of[id(seg.param)], seg.param
            n = seg.end - seg.start
            for k, dst in (("exp_avg", opt.exp_avg[i]), ("exp_avg_sq", opt.exp_avg_sq[i]), ("master", opt.master[i])):
                if k == "master" and opt.master_is_param:
                    continue
                full = f.get_tensor(f"{name}.{k}")
                local = full_to_local(p, full.to(p.device)).flatten()
                dst.copy_(local[seg.param_offset:seg.param_offset + n])
            opt.steps[i].fill_(f.get_tensor(f"{name}.step").item())
    rng_file = step_dir / "rng.pt"
    if rng_file.is_file() and engine.mesh.world_size == 1:
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


__all__ = ["CheckpointError", "ConfigError", "load_checkpoint", "read_meta", "read_model_config", "resolve_checkpoint",
           "save_checkpoint"]
