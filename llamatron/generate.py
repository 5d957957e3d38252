"""Sampling from a trained model, for demos and smoke tests (single process)."""

from __future__ import annotations

import torch

from .checkpoint import open_weights
from .models import ModelConfig, Transformer, build_model


@torch.no_grad()
def sample(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """Autoregressive sampling (full recompute per token: small models only); temperature <= 0: greedy."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: start from at least one token (e.g. the tokenizer's BOS)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1, or None for no top-k cut")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    window = model.cfg.max_seq_length
    for _ in range(max_new_tokens):
        logits = model(ids[:, -window:])[:, -1, :].float()
        if temperature <= 0:
            next_id = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, next_id], dim=1)
        if stop_id is not None and int(next_id) == stop_id:
            break
    return ids[0, len(prompt_ids) :].tolist()


def load_for_generation(path: str, device: str = "cpu") -> tuple[Transformer, dict]:
    """Model weights of a checkpoint, on one device, in fp32."""
    weights = open_weights(path)  # full tensors, whatever layout saved them
    meta = weights.run_meta
    cfg = ModelConfig.from_dict(meta["model_config"])
    model = build_model(cfg, device="meta")
    model.load_state_dict({k: weights.get(k).to(device, torch.float32) for k in weights.keys()}, assign=True)
    return model.eval(), meta
