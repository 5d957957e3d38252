"""Sampling from a trained model: a KV cache, stopping rules, on one device or tensor-parallel ranks.

The prompt runs once (the prefill) and fills a KV cache (models/kv_cache.py); each new token then runs alone,
attending to the cached keys. The tokens are those of recomputing the whole sequence for every token, which
`use_cache=False` still does (the reference the cache is tested against). Where the cached keys are not what
the whole sequence would compute, the cache is refilled from the whole (cropped) sequence instead: past the
model's context, where the sequence is cut to its last `max_seq_length` tokens and every position shifts, and
under dynamic NTK rope scaling past the trained context, where the frequencies change with the length.

Under tensor parallelism every rank runs the same loop on its shard of the model (and holds its KV heads'
cache); the logits of the whole vocabulary are gathered on every rank, so every rank draws the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ..adapters.merge import open_model_weights
from ..checkpoint import load_model_weights, read_model_config
from ..models import Transformer, build_model
from ..models.kv_cache import KVCache
from ..models.layers import rope_depends_on_length
from ..parallel.expert import apply_expert_parallel
from ..parallel.mesh import Mesh
from ..parallel.param_spec import param_specs
from ..parallel.tensor import apply_tensor_parallel
from ..parallel.tensor_layers import gather_vocab


class StopStrings:
    """Stop once the generated text holds one of `strings`; `cut` ends the text before the first of them."""

    def __init__(self, decode: Callable[[list[int]], str], strings: Sequence[str]):
        if any(not s for s in strings):
            raise ValueError("a stop string is empty: it would stop before the first token")
        self.decode, self.strings = decode, list(strings)

    def __call__(self, ids: list[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def cut(self, text: str) -> str:
        ends = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[: min(ends)] if ends else text


def next_token_logits(model: Transformer, ids: list[int], cache: KVCache | None) -> torch.Tensor:
    """fp32 logits over the whole vocabulary of the token after `ids`: from the last token alone where `cache`
    holds every earlier one as the whole sequence computes it, else from the whole sequence (its last
    max_seq_length tokens), refilling `cache`."""
    cfg, n = model.cfg, len(ids)
    window = cfg.max_seq_length
    if cache is not None and cache.length == n - 1 and n <= window and not rope_depends_on_length(cfg, n):
        inputs = ids[-1:]
    else:
        inputs = ids[-window:]
        if cache is not None:
            cache.reset()
    device = next(model.parameters()).device
    logits = model(torch.tensor([inputs], dtype=torch.long, device=device), cache=cache)[0, -1]
    return gather_vocab(logits, model.parallel.vocab).float()  # tensor parallelism: each rank holds a shard


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))


@torch.no_grad()
def sample(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop_ids: Collection[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Up to `max_new_tokens` new tokens after the prompt; temperature <= 0: greedy. Ends after a token in
    `stop_ids` (which is then the last one returned) or once `stop(new tokens)` is true. use_cache=False:
    recompute the whole sequence for every token (the reference)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: start from at least one token (e.g. the tokenizer's BOS)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1, or None for no top-k cut")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    length = min(len(prompt_ids) + max_new_tokens, model.cfg.max_seq_length)
    cache = KVCache(length) if use_cache else None
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        next_id = _pick(next_token_logits(model, ids, cache), temperature, top_k, gen)
        ids.append(next_id)
        new.append(next_id)
        if next_id in stop_ids or (stop is not None and stop(new)):
            break
    return new


def load_for_generation(
    path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, mesh: Mesh | None = None
) -> tuple[Transformer, dict]:
    """The model of a checkpoint saved under any layout, on one device (or this rank's tensor-parallel shard of it
    when `mesh` has tp > 1), in `dtype`; and its meta.json."""
    model = build_model(read_model_config(path), device="meta")
    specs = param_specs(model)
    if mesh is not None and mesh.tp > 1:
        specs = apply_tensor_parallel(model, mesh, specs=specs)
        if model.cfg.is_moe:  # every expert split along its ffn too (parallel/expert.py)
            specs = apply_expert_parallel(model, mesh, False, specs)
    model.to(dtype=dtype)  # still on meta: free
    model.to_empty(device=device)
    meta = load_model_weights(open_model_weights(path), model, specs)  # a LoRA checkpoint merged
    return model.eval(), meta
