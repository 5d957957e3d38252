"""How the next token is drawn from a model's logits: greedy, or sampled after a repetition penalty, the
temperature, top-k and top-p, in the order transformers' generate applies them.

Every function works on a batch of fp32 logits (rows, vocabulary) with device ops of fixed shapes and no read on
the host, so the decoding step captured in a CUDA graph (inference/decode.py) runs them too.

A sample is the exponential race torch.multinomial runs for one draw: argmax_i p_i / e_i with e_i ~ Exp(1). The
e_i are drawn from the run's seeded generator into a buffer before each step (`draw_noise`), outside the graph:
the same seed gives the same tokens, with or without the graph, recomputing or with the KV cache, and on every
tensor-parallel rank (each draws the same numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature <= 0: greedy (the likeliest token after the repetition penalty; top-k and top-p do not apply).
    top_k None and top_p 1: no cut; repetition_penalty 1: none (> 1 makes a token already in the row's prompt or
    output less likely: its logit divided by the penalty, or multiplied where negative, as transformers does)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def problems(self, flags: bool = False) -> list[str]:
        """What cannot run, named as the command's flags (`--top-p 2.0`) or the fields (`top_p=2.0`)."""

        def name(field: str) -> str:
            return f"--{field.replace('_', '-')} " if flags else f"{field}="

        out = []
        if not 0 <= self.temperature < math.inf:  # also NaN
            out.append(f"{name('temperature')}{self.temperature}: must be >= 0 (0: greedy) and finite")
        if self.top_k is not None and self.top_k < 1:
            out.append(f"{name('top_k')}{self.top_k}: must be >= 1 (1: always the likeliest token)")
        if not 0 < self.top_p <= 1:
            out.append(f"{name('top_p')}{self.top_p}: must be in (0, 1] (1: no nucleus cut)")
        if not 0 < self.repetition_penalty < math.inf:
            out.append(f"{name('repetition_penalty')}{self.repetition_penalty}: must be > 0 and finite (1: none)")
        return out

    @property
    def needs_seen(self) -> bool:
        """Whether a step needs each row's seen tokens (the repetition penalty)."""
        return self.repetition_penalty != 1


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """A token seen in its row (seen: (rows, vocabulary) bool) gets logit / penalty, or logit * penalty where the
    logit is negative: less likely either way for penalty > 1."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Every logit below the row's k-th largest set to -inf (ties with it stay)."""
    kth = torch.topk(logits, min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The nucleus: the likeliest tokens until their probability reaches p (always the likeliest one); the others
    -inf. A token is cut where the tokens likelier than it already hold p."""
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # the probability of the likelier tokens
    cut = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= p)
    return logits.masked_fill(cut, float("-inf"))


def process(logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The logits a token is drawn from: repetition penalty, then (sampling) temperature, top-k, top-p."""
    if sampling.needs_seen:
        assert seen is not None, "the repetition penalty needs each row's seen tokens"
        logits = penalize_repetition(logits, seen, sampling.repetition_penalty)
    if sampling.greedy:
        return logits
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        logits = keep_top_k(logits, sampling.top_k)
    if sampling.top_p < 1:
        logits = keep_top_p(logits, sampling.top_p)
    return logits


def draw_noise(noise: torch.Tensor, generator: torch.Generator) -> None:
    """Fill `noise` (rows, vocabulary) with Exp(1) draws for the next `choose`."""
    noise.exponential_(generator=generator)


def choose(logits: torch.Tensor, sampling: Sampling, noise: torch.Tensor | None = None) -> torch.Tensor:
    """(rows,) the next token of each row from processed logits: the argmax (greedy), else a draw from their
    softmax with `noise` (draw_noise)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    assert noise is not None, "sampling needs its noise drawn (draw_noise)"
    return (torch.softmax(logits, dim=-1) / noise).argmax(dim=-1)


def next_tokens(
    logits: torch.Tensor, sampling: Sampling, seen: torch.Tensor | None = None, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """process, then choose: (rows,) token ids from (rows, vocabulary) fp32 logits."""
    return choose(process(logits, sampling, seen), sampling, noise)
