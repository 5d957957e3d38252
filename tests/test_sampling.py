"""The sampling processors against transformers' own logits processors on the same logits (an independent
reference), the draw against the softmax it samples, and the stopping rules."""

from __future__ import annotations

import pytest
import torch

from llamatron.errors import CheckpointError
from llamatron.inference.sampling import (
    Sampling,
    choose,
    draw_noise,
    keep_top_k,
    keep_top_p,
    penalize_repetition,
    process,
)
from llamatron.inference.stops import StopStrings, eos_ids_of, stop_length

logits_process = pytest.importorskip("transformers.generation.logits_process")

ROWS, VOCAB = 4, 200


def logits_and_ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    ids = torch.randint(0, VOCAB, (ROWS, 30), generator=gen)  # a row's prompt and output so far, with repeats
    return logits, ids


def seen_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ids.shape[0], VOCAB, dtype=torch.bool).scatter_(1, ids, True)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers(penalty):
    logits, ids = logits_and_ids()
    theirs = logits_process.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    ours = penalize_repetition(logits, seen_of(ids), penalty)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("k", [1, 7, 50, VOCAB + 5])
def test_top_k_is_transformers(k):
    logits, ids = logits_and_ids(1)
    logits[0, :10] = logits[0, 3]  # ties at the cut stay, as in transformers
    theirs = logits_process.TopKLogitsWarper(k)(ids, logits.clone())
    assert torch.equal(keep_top_k(logits, k), theirs)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_is_transformers(p):
    logits, ids = logits_and_ids(2)
    theirs = logits_process.TopPLogitsWarper(p)(ids, logits.clone())
    ours = keep_top_p(logits, p)
    assert torch.equal(ours.isinf(), theirs.isinf()) and torch.equal(ours, theirs)
    assert (ours.isfinite().sum(-1) >= 1).all()


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=0.7),
        Sampling(temperature=1.5, top_k=20),
        Sampling(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2),
        Sampling(temperature=1.0, top_p=0.5, repetition_penalty=0.9),
    ],
)
def test_the_chain_is_transformers_in_its_order(sampling):
    """generate's order: the repetition penalty, then temperature, top-k, top-p."""
    logits, ids = logits_and_ids(3)
    chain = [logits_process.RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)]
    chain.append(logits_process.TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k is not None:
        chain.append(logits_process.TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        chain.append(logits_process.TopPLogitsWarper(sampling.top_p))
    theirs = logits_process.LogitsProcessorList(chain)(ids, logits.clone())
    ours = process(logits, sampling, seen_of(ids))
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.allclose(ours[ours.isfinite()], theirs[theirs.isfinite()], rtol=1e-6, atol=0)


def test_greedy_takes_the_likeliest_after_the_penalty_only():
    logits, ids = logits_and_ids(4)
    greedy = Sampling(temperature=0, top_k=1, top_p=0.1, repetition_penalty=1.5)
    expected = penalize_repetition(logits, seen_of(ids), 1.5).argmax(-1)
    assert torch.equal(choose(process(logits, greedy, seen_of(ids)), greedy), expected)


def test_a_draw_follows_the_softmax_and_never_takes_a_cut_token():
    """The exponential race: token i with probability softmax(logits)_i (checked on 40,000 draws)."""
    draws, logits = 40_000, torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    sampling = Sampling(temperature=1.0, top_k=5)
    processed = process(logits.expand(draws, -1), sampling)
    noise = torch.empty(draws, len(logits))
    draw_noise(noise, torch.Generator().manual_seed(0))
    counts = torch.bincount(choose(processed, sampling, noise), minlength=len(logits)).double()
    probs = torch.softmax(logits[:5].double(), -1)
    sigma = (draws * probs * (1 - probs)).sqrt()
    assert ((counts[:5] - draws * probs).abs() <= 4 * sigma).all(), (counts, draws * probs)
    assert counts[5] == 0  # cut by top-k


def test_the_same_seed_draws_the_same_noise():
    a, b, c = (torch.empty(2, 50) for _ in range(3))
    draw_noise(a, torch.Generator().manual_seed(7))
    draw_noise(b, torch.Generator().manual_seed(7))
    draw_noise(c, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c) and (a > 0).all()


def test_stop_length_keeps_through_the_first_stop():
    assert stop_length([4, 5, 6, 7], 0, {6, 7}, None) == 3  # through the first EOS, which is kept
    assert stop_length([4, 5, 6, 7], 0, set(), None) is None
    assert stop_length([4, 5, 6, 7], 3, {6}, None) is None  # tokens already checked are not read again

    def decode(ids):
        return "".join(chr(ord("a") + i) for i in ids)

    stops = StopStrings(decode, ["fg", "zz"])
    assert stop_length([4, 5, 6, 7], 0, set(), stops) == 3  # "efg": the shortest prefix that holds "fg"
    assert stop_length([4, 5, 6, 7], 0, {5}, stops) == 2  # EOS first
    assert stops.cut("abcdefgh") == "abcde"
    both = StopStrings(decode, ["fg", "cd", "de"])  # all occur: the cut is before the first to start, not the last
    assert both.cut("abcdefgh") == "ab" and both.cut("abcdefghcd") == "ab"
    assert stop_length([0, 1, 2, 3, 4, 5, 6], 0, set(), both) == 4  # "abcd": stopped where "cd" ends
    with pytest.raises(ValueError, match="a stop string is empty"):
        StopStrings(decode, ["x", ""])


def test_eos_ids_from_an_imported_generation_config():
    assert eos_ids_of({}) == set()
    hf = {"config": {"eos_token_id": 2}, "generation_config": {"eos_token_id": [128001, 128009]}}
    assert eos_ids_of({"hf": hf}) == {128001, 128009}  # generation_config.json first: Llama 3's instruct list
    assert eos_ids_of({"hf": {**hf, "generation_config": {"eos_token_id": 5}}}) == {5}
    assert eos_ids_of({"hf": {**hf, "generation_config": None}}) == {2}  # else config.json's
    with pytest.raises(CheckpointError, match="eos_token_id 'x': not a token id or a list of them"):
        eos_ids_of({"hf": {"generation_config": {"eos_token_id": "x"}}})
