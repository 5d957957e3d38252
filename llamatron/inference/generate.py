"""Generating text from a trained model, on one device or tensor-parallel ranks: the library's entry points.

`generate_batch` runs a batch of prompts through the decoder of inference/decode.py (a KV cache of fixed shape,
per-row positions, the step captured in a CUDA graph on GPU); `sample` is one prompt. Where a fixed cache cannot
hold what the whole sequence would compute, each prompt runs alone through `next_token_logits`, which refills a
growing cache from the whole (cropped) sequence: past the model's context, where the sequence is cut to its last
`max_seq_length` tokens and every position shifts, and under dynamic NTK rope scaling past the trained context,
where the frequencies change with the length. `use_cache=False` recomputes the whole sequence for every token (the
reference the caches are tested against). All of them draw tokens the same way (inference/sampling.py).

Under tensor parallelism every rank runs the same loop on its shard of the model (and holds its KV heads'
cache); the logits of the whole vocabulary are gathered on every rank, so every rank draws the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ..adapters.merge import open_model_weights
from ..checkpoint import load_model_weights, read_model_config
from ..models import ModelConfig, Transformer, build_model
from ..models.init import to_empty
from ..models.kv_cache import KVCache
from ..models.layers import rope_depends_on_length
from ..parallel.expert import apply_expert_parallel
from ..parallel.mesh import Mesh
from ..parallel.param_spec import param_specs
from ..parallel.tensor import apply_tensor_parallel
from ..parallel.tensor_layers import gather_vocab
from .decode import Decoder
from .sampling import Sampling, draw_noise, next_tokens
from .stops import StopStrings

__all__ = ["StopStrings", "fits_fixed_cache", "generate_batch", "load_for_generation", "next_token_logits", "sample"]


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


def fits_fixed_cache(cfg: ModelConfig, length: int) -> bool:
    """Whether `length` tokens (a prompt and its new tokens) decode with the fixed KV cache of inference/decode.py:
    within the context, and before dynamic NTK scaling changes the rotary frequencies."""
    return length <= cfg.max_seq_length and not rope_depends_on_length(cfg, length)


def _one_prompt(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    stop_ids: Collection[int],
    stop: Callable[[list[int]], bool] | None,
    use_cache: bool,
) -> list[int]:
    """One prompt, one token at a time: the growing cache where it is exact, else (and with use_cache=False) the
    whole (cropped) sequence for every token. The reference, and what runs past the fixed cache's reach."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    vocab = model.cfg.vocab_size
    cache = KVCache(min(len(prompt_ids) + max_new_tokens, model.cfg.max_seq_length)) if use_cache else None
    seen = torch.zeros(1, vocab, dtype=torch.bool, device=device) if sampling.needs_seen else None
    if seen is not None:
        seen[0, list(prompt_ids)] = True
    noise = None if sampling.greedy else torch.empty(1, vocab, device=device)
    ids, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, ids, cache)[None]
        if noise is not None:
            draw_noise(noise, generator)
        next_id = int(next_tokens(logits, sampling, seen, noise)[0])
        ids.append(next_id)
        new.append(next_id)
        if seen is not None:
            seen[0, next_id] = True
        if next_id in stop_ids or (stop is not None and stop(new)):
            break
    return new


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    seed: int = 0,
    stop_ids: Collection[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
    cuda_graph: bool | None = None,
    compile: bool = False,
    batch_size: int | None = None,
) -> list[list[int]]:
    """Up to `max_new_tokens` new tokens after each prompt (greedy by default), the prompts decoded together, up to
    `batch_size` at a time (default: all). A prompt's output ends after a token in `stop_ids` (the last one
    returned) or once `stop(its new tokens)` holds. cuda_graph, compile: inference/decode.Decoder's."""
    sampling = sampling if sampling is not None else Sampling(temperature=0)
    problems = sampling.problems()
    if not prompts:
        problems.append("no prompts: give at least one")
    problems += [f"prompt {i} is empty: start it from a token (e.g. BOS)" for i, p in enumerate(prompts) if not p]
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if batch_size is not None and batch_size < 1:
        problems.append(f"batch_size={batch_size}: must be >= 1")
    if problems:
        raise ValueError("; ".join(problems))
    longest = max(len(p) for p in prompts)
    if fits_fixed_cache(model.cfg, longest + max_new_tokens):
        size = min(batch_size or len(prompts), len(prompts))
        decoder = Decoder(model, size, longest + max_new_tokens, sampling, cuda_graph, compile)  # one for every batch:
        batches = (prompts[start : start + size] for start in range(0, len(prompts), size))  # one capture on GPU
        return [out for batch in batches for out in decoder.generate(batch, max_new_tokens, seed, stop_ids, stop)]
    return [_one_prompt(model, p, max_new_tokens, sampling, seed, stop_ids, stop, True) for p in prompts]


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
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> list[int]:
    """Up to `max_new_tokens` new tokens after the prompt; temperature <= 0: greedy. Ends after a token in
    `stop_ids` (which is then the last one returned) or once `stop(new tokens)` is true. use_cache=False:
    recompute the whole sequence for every token (the reference)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: start from at least one token (e.g. the tokenizer's BOS)")
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
    problems = sampling.problems()
    if problems:
        raise ValueError("; ".join(problems))
    if max_new_tokens < 1:
        return []
    if use_cache:
        return generate_batch(model, [prompt_ids], max_new_tokens, sampling, seed, stop_ids, stop)[0]
    return _one_prompt(model, prompt_ids, max_new_tokens, sampling, seed, stop_ids, stop, use_cache=False)


def load_for_generation(
    path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, mesh: Mesh | None = None
) -> tuple[Transformer, dict]:
    """The model of a checkpoint saved under any layout, on one device (or this rank's tensor-parallel shard of it
    when `mesh` has tp > 1), in `dtype`; and its meta.json."""
    model = build_model(read_model_config(path), device="meta")
    specs = param_specs(model)
    if mesh is not None and mesh.layout.tp > 1:
        specs = apply_tensor_parallel(model, mesh, specs=specs)
        if model.cfg.is_moe:  # every expert split along its ffn too (parallel/expert.py)
            specs = apply_expert_parallel(model, mesh, False, specs)
    model.to(dtype=dtype)  # still on meta: free
    to_empty(model, device)
    meta = load_model_weights(open_model_weights(path), model, specs)  # a LoRA checkpoint merged
    return model.eval(), meta
