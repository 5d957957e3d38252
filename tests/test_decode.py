"""Batched decoding with the fixed KV cache (inference/decode.py) gives the tokens, and the logits, of recomputing
the whole sequence for every token (greedy, fp32), for prompts of different lengths together as for each alone:
Llama, a sliding window shorter than the sequence (Mistral-style) and Qwen3 (q/k norms, its own head_dim)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llamatron.inference.decode import Decoder
from llamatron.inference.generate import generate_batch, sample
from llamatron.inference.sampling import Sampling
from llamatron.models import RopeScaling, build_model, get_preset, materialize
from llamatron.models.kv_cache import KVCache

PRESETS = ["llama-test", "mistral-test", "qwen3-test"]  # mistral-test: a window of 16 < 6 + 24 tokens
# llama4-test: chunks of 16 tokens, a NoPE layer whose temperature changes every 8 positions, MoE layers
RECOMPUTED = [*PRESETS, "llama4-test"]
TOKENS = [5, 17, 99, 3, 42, 7, 200, 11, 64, 128, 31]
PROMPTS = [TOKENS[:3], TOKENS[:11], TOKENS[:1], TOKENS[:6]]  # lengths 3, 11, 1, 6
NEW = 24


def tiny(preset: str, dtype: torch.dtype = torch.float32):
    # init_std 0.3: a random model whose next token depends on its context (at 0.02 it repeats one token)
    cfg = dataclasses.replace(get_preset(preset), init_std=0.3)
    return materialize(build_model(cfg), cfg, 1, "cpu", dtype).eval()


def full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]))[0, -1]


@pytest.mark.parametrize("preset", RECOMPUTED)
@torch.no_grad()
def test_per_row_steps_give_the_full_recompute_logits(preset):
    """The cache itself: a right-padded prefill, then one token per row at each row's own position."""
    model = tiny(preset)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    padded = torch.tensor([p + [0] * (11 - len(p)) for p in PROMPTS])
    cache = KVCache(11 + NEW)
    logits = model(padded, cache=cache, logits_at=lengths - 1)[:, -1]
    cache.continue_rows(lengths)
    seqs = [list(p) for p in PROMPTS]
    for step in range(NEW):
        for row, ids in enumerate(seqs):
            full = full_logits(model, ids)
            assert (logits[row] - full).abs().max() <= 1e-5 * full.abs().max(), (step, row)  # fp32 rounding
        chosen = logits.argmax(-1)
        for ids, token in zip(seqs, chosen.tolist()):
            ids.append(token)
        logits = model(chosen[:, None], cache=cache)[:, -1]
    assert cache.positions.tolist() == [len(p) + NEW for p in PROMPTS]
    assert all(len(set(ids[len(p) :])) >= 4 for ids, p in zip(seqs, PROMPTS))  # depends on the context


@pytest.mark.parametrize("preset", RECOMPUTED)
def test_batched_prompts_decode_as_each_alone_and_as_the_recompute(preset):
    model = tiny(preset)
    batched = generate_batch(model, PROMPTS, NEW)
    assert generate_batch(model, PROMPTS, NEW, batch_size=3) == batched  # one decoder: a batch of 3, then of 1
    for prompt, tokens in zip(PROMPTS, batched):
        assert tokens == sample(model, prompt, NEW, temperature=0, use_cache=False)  # recompute every token
        assert tokens == generate_batch(model, [prompt], NEW)[0]  # alone, through the decoder


def test_the_prompt_runs_once_then_one_token_per_row_and_step():
    model = tiny("llama-test")
    shapes = []
    model.embed.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    generate_batch(model, [TOKENS[:2], TOKENS[:5]], 4)
    assert shapes == [(2, 5)] + [(2, 1)] * 3


def test_a_decoder_is_reused_across_batches_and_fewer_prompts():
    """The buffers (and on GPU the captured graph) stay; each call starts from its own prefill."""
    model = tiny("mistral-test")
    decoder = Decoder(model, batch=4, max_length=11 + NEW)
    first = decoder.generate(PROMPTS, NEW)
    layer = decoder.cache.layer("0")
    buffers = [t.data_ptr() for t in (layer.keys, layer.values, decoder.cache.positions, decoder.tokens)]
    assert decoder.generate(PROMPTS[2:], NEW) == first[2:]  # two dummy rows
    assert decoder.generate(PROMPTS, NEW) == first
    # what a captured graph reads and writes stays where it was
    assert [t.data_ptr() for t in (layer.keys, layer.values, decoder.cache.positions, decoder.tokens)] == buffers


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.9, top_k=20),
        Sampling(temperature=1.3, top_p=0.8),
        Sampling(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.3),
        Sampling(temperature=0, repetition_penalty=1.5),  # greedy after the penalty
    ],
)
def test_sampling_draws_the_same_tokens_with_the_decoder_as_recomputing(sampling):
    model = tiny("llama-test")
    args = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    args.update(repetition_penalty=sampling.repetition_penalty, seed=3)
    drawn = sample(model, PROMPTS[3], NEW, **args)
    assert drawn == sample(model, PROMPTS[3], NEW, use_cache=False, **args)
    assert drawn == generate_batch(model, [PROMPTS[3]], NEW, sampling, seed=3)[0]
    if not sampling.greedy:
        assert drawn != sample(model, PROMPTS[3], NEW, **{**args, "seed": 4})


def test_the_repetition_penalty_changes_greedy_tokens():
    model = tiny("llama-test")
    plain = generate_batch(model, PROMPTS, NEW)
    penalised = generate_batch(model, PROMPTS, NEW, Sampling(temperature=0, repetition_penalty=3.0))
    assert plain != penalised
    # a strong penalty: no token repeats while unseen ones remain likely enough
    assert sum(len(set(r)) for r in penalised) > sum(len(set(r)) for r in plain)


def test_stops_end_each_row_where_its_rule_holds():
    model = tiny("llama-test")
    free = generate_batch(model, PROMPTS, NEW)
    # EOS list: row 1 stops at its 5th token, row 3 at its 8th (whichever id comes first); a row may hold neither
    eos = {free[1][4], free[3][7]}
    stopped = generate_batch(model, PROMPTS, NEW, stop_ids=eos)
    for row, tokens in zip(free, stopped):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        assert tokens == row[:end]

    # a rule on the new tokens (a stop string, here on their ids): the shortest prefix it holds for
    def stop(ids):
        return free[0][6] in ids

    stopped = generate_batch(model, PROMPTS, NEW, stop=stop)
    for row, tokens in zip(free, stopped):
        end = next((i + 1 for i, t in enumerate(row) if t == free[0][6]), len(row))
        assert tokens == row[:end]
    assert len(stopped[0]) <= 7

    # checking every 5 steps (as on a GPU): the same outputs, cut where each row stopped
    decoder = Decoder(model, 4, 11 + NEW)
    decoder.check_every = 5
    assert decoder.generate(PROMPTS, NEW, stop_ids=eos, stop=stop) == generate_batch(
        model, PROMPTS, NEW, stop_ids=eos, stop=stop
    )


def test_all_rows_stopped_ends_the_decoding():
    model = tiny("llama-test")
    free = generate_batch(model, PROMPTS, NEW)
    steps = []
    model.embed.register_forward_pre_hook(lambda _m, args: steps.append(args[0].shape[1]))
    generate_batch(model, PROMPTS, NEW, stop_ids={t for row in free for t in row[:3]})
    assert len(steps) <= 3  # the prefill and at most two steps: every row has stopped by its third token


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[]), "no prompts: give at least one"),
        (dict(prompts=[[1], []]), "prompt 1 is empty"),
        (dict(max_new_tokens=0), "max_new_tokens=0: must be >= 1"),
        (dict(batch_size=0), "batch_size=0: must be >= 1"),
        (dict(sampling=Sampling(top_p=0.0)), "top_p=0.0: must be in (0, 1]"),
        (dict(sampling=Sampling(top_p=1.5)), "top_p=1.5: must be in (0, 1]"),
        (dict(sampling=Sampling(repetition_penalty=0.0)), "repetition_penalty=0.0: must be > 0"),
        (dict(sampling=Sampling(temperature=float("nan"))), "temperature=nan: must be >= 0"),
    ],
)
def test_bad_input_is_refused_before_the_model_runs(kwargs, message):
    args = {"model": None, "prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        generate_batch(**args)


def test_a_decoder_refuses_what_it_cannot_hold():
    model = tiny("llama-test")  # context 128
    with pytest.raises(ValueError, match="max_length=129: must be in \\[2, the model's context 128\\]"):
        Decoder(model, 1, 129)
    decoder = Decoder(model, 2, 10)
    with pytest.raises(ValueError, match="max_new_tokens=8 after a prompt of 3 tokens: must be >= 1 and fit"):
        decoder.generate([[1, 2, 3], [4]], 8)
    with pytest.raises(ValueError, match="3 prompts for a decoder of batch 2"):
        decoder.generate([[1], [2], [3]], 2)
    with pytest.raises(ValueError, match="cuda_graph=True on cpu"):
        Decoder(model, 1, 10, cuda_graph=True)
    # past the context generate_batch recomputes (the sequence slides), as sample always has
    assert len(generate_batch(model, [TOKENS], 128)[0]) == 128


class HostReads(TorchDispatchMode):
    """The ops that read a tensor's value on the host or whose output shape depends on it: a CUDA graph cannot
    capture them (on a GPU they synchronise, and a replay would not redo the host's part)."""

    READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.removeprefix("aten::") in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", [*PRESETS, "falcon-test"])
def test_the_decoding_step_never_reads_a_value_on_the_host(preset):
    """What makes the step capturable, checked on CPU: no host read from the tokens to the next ones (sampling with
    every processor), and the positions advance on the device."""
    model = tiny(preset)
    sampling = Sampling(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2)
    decoder = Decoder(model, 4, 11 + NEW, sampling)
    decoder.generate(PROMPTS, 2)  # a prefill, a step
    before = decoder.cache.positions.clone()
    with torch.no_grad(), HostReads() as reads:
        decoder._step()
    assert reads.seen == [] and torch.equal(decoder.cache.positions, before + 1)


def test_the_host_read_check_finds_one():
    """Dynamic NTK rope reads the longest position on the host (the Decoder captures no graph for it)."""
    cfg = dataclasses.replace(get_preset("llama-test"), rope_scaling=RopeScaling("dynamic", 2.0, 96))
    dynamic = Decoder(materialize(build_model(cfg), cfg, 1, "cpu", torch.float32).eval(), 4, 11 + NEW)
    dynamic.generate(PROMPTS, 2)
    with torch.no_grad(), HostReads() as reads:
        dynamic._step()
    assert reads.seen == ["aten._local_scalar_dense.default"]


@pytest.mark.parametrize("preset", ["llama-test", "deepseek-v3-test"])
@torch.no_grad()
def test_every_attention_call_goes_through_the_layers_replaceable_core(preset):
    """models/attention.py's attend is the one call: the prefill and each per-row decoding step (the decode kernel's
    path, and the latent attention's absorbed one) reach each layer's `core`, which selective recompute and
    context parallelism wrap; the module itself picks no kernel. The logits stay the full recompute's."""
    model = tiny(preset)
    calls: list[tuple[bool, bool]] = []  # (a decode_mask's rows, a cache given) per call
    for layer in model.layers.values():
        inner = layer.attn.core

        def core(q, k, v, mask, cache, backend, _inner=inner):
            calls.append((mask is not None and mask.rows is not None, cache is not None))
            return _inner(q, k, v, mask, cache, backend)

        layer.attn.core = core
    prompts = PROMPTS[:2]
    lengths = torch.tensor([len(p) for p in prompts])
    cache = KVCache(11 + 2)
    model(torch.tensor([p + [0] * (11 - len(p)) for p in prompts]), cache=cache, logits_at=lengths - 1)
    cache.continue_rows(lengths)
    layers = len(model.layers)
    assert len(calls) == layers and not any(rows for rows, _ in calls)
    chosen = torch.tensor([7, 9])
    logits = model(chosen[:, None], cache=cache)[:, -1]
    assert len(calls) == 2 * layers and all(rows for rows, _ in calls[layers:])
    for row, p in enumerate(prompts):
        full = full_logits(model, [*p, int(chosen[row])])
        assert (logits[row] - full).abs().max() <= 1e-5 * full.abs().max()
