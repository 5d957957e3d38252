"""Batched decoding at the speed of the memory: a KV cache of fixed shape and a decoding step captured once in a
CUDA graph, then replayed once per token.

A decoding step of a small model launches hundreds of small kernels; from Python each costs more than the GPU
takes to run it, so an eager step is bound by the launches (issue 37: llama-1b at 96 tokens/s on an H200, where
reading its weights once per token allows ~2,800). A CUDA graph records the step's kernels once and replays them
with one launch. That needs a step whose shapes and buffers never change and which never reads a value on the
host:

- the KV cache (models/kv_cache.py) holds `max_length` slots per row, allocated once; the prompts run together,
  right-padded, through the model's own forward (the training attention path: causal, no mask beyond a sliding
  window; the padding after a shorter prompt is never seen by its tokens); each row then continues at its own
  position (per-sequence positions), so a step is one token per row: each layer writes its key and value into
  the row's slot and attends to the slots up to it, through a per-row mask (models/attention.decode_mask);
- the step's inputs and outputs are fixed buffers: the tokens, the positions (advanced on the device), the
  sampling noise (drawn from the seeded generator before each replay, inference/sampling.py) and each row's
  seen tokens (the repetition penalty); the next token is chosen inside the step.

torch.cuda.CUDAGraph, not torch.compile(mode="reduce-overhead"): the graph is captured where and when this module
says, on the step as it runs eagerly (training's Triton kernels included), in every torch this project supports
(2.11 to 2.13); Inductor's CUDA-graph trees decide for themselves whether to graph a function, skip it when it
mutates inputs they do not know to be static (the KV cache here: transformers marks its static cache's tensors
with torch._dynamo.mark_static_address for them) and have changed those rules between releases. `compile=True`
fuses the step's small kernels with torch.compile (no CUDA graphs of its own) before the same capture.

The same step runs eagerly on CPU, under tensor parallelism (each step all-gathers the logits; not captured yet), for
a mixture of experts (its fp32 expert loop reads counts on the host; the bf16 grouped GEMMs are not checked under
capture yet) and under dynamic NTK rope scaling (which reads the longest position on the host). Every rank of a
tensor-parallel group runs the same loop and draws the same tokens.

Stopping rules are checked on the host every `check_every` steps (1 on CPU; on GPU reading the tokens is a
synchronisation, so every 16: a finished row may run a few steps more, its output cut where it stopped).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ..models import Transformer
from ..models.kv_cache import KVCache
from ..models.layers import rope_depends_on_length
from ..parallel.tensor_layers import gather_vocab
from .sampling import Sampling, draw_noise, next_tokens
from .stops import stop_length

GPU_CHECK_EVERY = 16


class Decoder:
    """Generation for up to `batch` prompts at a time, each prompt plus its new tokens within `max_length`."""

    def __init__(
        self,
        model: Transformer,
        batch: int,
        max_length: int,
        sampling: Sampling | None = None,
        cuda_graph: bool | None = None,
        compile: bool = False,
        record_logps: bool = False,
    ):
        """cuda_graph: capture the step (default: on CUDA, for one device's dense model); compile: torch.compile
        the step first. sampling: greedy by default. record_logps: keep each drawn token's log-probability under
        the logits / temperature (GRPO's behaviour log-probabilities) in `logps` after `generate`."""
        self.sampling = sampling if sampling is not None else Sampling(temperature=0)
        cfg = model.cfg
        problems = self.sampling.problems()
        if batch < 1:
            problems.append(f"batch={batch}: must be >= 1")
        if not 2 <= max_length <= cfg.max_seq_length:
            problems.append(f"max_length={max_length}: must be in [2, the model's context {cfg.max_seq_length}]")
        elif rope_depends_on_length(cfg, max_length):
            problems.append(
                f"max_length={max_length}: past {cfg.rope_scaling.original_max_position} tokens dynamic NTK rope "  # type: ignore[union-attr]
                "scaling changes every cached key; generate recomputes there (inference/generate.py)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        self.model, self.batch, self.max_length = model, batch, max_length
        self.device = next(model.parameters()).device
        on_gpu = self.device.type == "cuda"
        if cuda_graph and not on_gpu:
            raise ValueError(f"cuda_graph=True on {self.device}: CUDA graphs need a CUDA device")
        # dynamic NTK rope reads the longest position on the host (models/layers.rope_cos_sin): no capture
        dynamic_rope = cfg.rope_scaling is not None and cfg.rope_scaling.kind == "dynamic"
        default = on_gpu and not cfg.is_moe and not dynamic_rope and model.parallel.vocab is None
        self.cuda_graph = default if cuda_graph is None else cuda_graph
        self.check_every = GPU_CHECK_EVERY if on_gpu else 1
        self.cache = KVCache(max_length)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        vocab = cfg.vocab_size
        needs_seen = self.sampling.needs_seen
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=self.device) if needs_seen else None
        self.noise = None if self.sampling.greedy else torch.ones(batch, vocab, device=self.device)
        self.chosen_logps = torch.zeros(batch, device=self.device) if record_logps else None
        self.logps: torch.Tensor | None = None  # (prompts, new tokens) of the last generate, with record_logps
        self._step_fn: Callable[[], None] = torch.compile(self._step, dynamic=False) if compile else self._step
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        """One token per row: the tokens in, the next ones out (into the same buffer), the positions advanced."""
        logits = self.model(self.tokens, cache=self.cache)[:, -1]
        logits = gather_vocab(logits, self.model.parallel.vocab).float()
        chosen = next_tokens(logits, self.sampling, self.seen, self.noise)
        self._record(logits, chosen)
        self.tokens.copy_(chosen[:, None])
        if self.seen is not None:
            self.seen.scatter_(1, chosen[:, None], True)

    def _record(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        """With record_logps: the chosen tokens' log-probabilities under logits / temperature (no top-k or top-p
        cut: the distribution training computes them from)."""
        if self.chosen_logps is not None:
            scaled = logits / max(self.sampling.temperature, 1e-6)
            self.chosen_logps.copy_(torch.log_softmax(scaled, -1).gather(1, chosen[:, None])[:, 0])

    def _draw_noise(self, generator: torch.Generator) -> None:
        """The next token's sampling noise (a subclass may key it otherwise: GRPO's rollouts, per row)."""
        assert self.noise is not None
        draw_noise(self.noise, generator)

    def _capture(self) -> None:
        """Record the step in a CUDA graph, after warm-up runs on a side stream (Triton's and torch.compile's
        first calls compile; cuBLAS makes its workspaces) at slot 0, which every prefill writes again."""
        self.cache.continue_rows(torch.zeros(self.batch, dtype=torch.long, device=self.device))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for step in (self._step, self._step_fn, self._step_fn):  # eager first: it allocates the cache
                assert self.cache.positions is not None
                self.cache.positions.zero_()
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step_fn()

    def _prefill(self, prompts: Sequence[Sequence[int]], generator: torch.Generator) -> torch.Tensor:
        """Run every prompt (right-padded; rows past the prompts get a one-token dummy); return the first new token
        of each row and set the buffers a step reads."""
        rows = [list(p) for p in prompts] + [[0]] * (self.batch - len(prompts))
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        padded = torch.tensor([r + [r[0]] * (max(map(len, rows)) - len(r)) for r in rows], device=self.device)
        if self.seen is not None:  # padding repeats a row's first token: it marks nothing new
            self.seen.zero_().scatter_(1, padded, True)
        self.cache.reset()
        logits = self.model(padded, cache=self.cache, logits_at=lengths - 1)[:, -1]
        logits = gather_vocab(logits, self.model.parallel.vocab).float()
        self.cache.continue_rows(lengths)
        if self.noise is not None:
            self._draw_noise(generator)
        first = next_tokens(logits, self.sampling, self.seen, self.noise)
        self._record(logits, first)
        self.tokens.copy_(first[:, None])
        if self.seen is not None:
            self.seen.scatter_(1, first[:, None], True)
        return first

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        seed: int = 0,
        stop_ids: Collection[int] = (),
        stop: Callable[[list[int]], bool] | None = None,
    ) -> list[list[int]]:
        """Up to `max_new_tokens` new tokens after each prompt. A row ends after a token in `stop_ids` (the last
        one returned) or once `stop(its new tokens)` holds (see stops.stop_length); all rows end together."""
        longest = max((len(p) for p in prompts), default=0)
        if not 1 <= len(prompts) <= self.batch or min(len(p) for p in prompts) < 1:
            raise ValueError(f"{len(prompts)} prompts for a decoder of batch {self.batch}; each needs a token")
        if max_new_tokens < 1 or longest + max_new_tokens > self.max_length:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} after a prompt of {longest} tokens: must be >= 1 and fit the "
                f"decoder's max_length {self.max_length}"
            )
        if self.cuda_graph and self.graph is None:
            self._capture()
        generator = torch.Generator(self.device).manual_seed(seed)
        out = torch.empty(self.batch, max_new_tokens, dtype=torch.long, device=self.device)
        out[:, 0] = self._prefill(prompts, generator)
        logps = None if self.chosen_logps is None else torch.empty(out.shape, device=self.device)
        if logps is not None and self.chosen_logps is not None:
            logps[:, 0] = self.chosen_logps
        ends: list[int | None] = [None] * len(prompts)
        checked = [0] * len(prompts)
        every = self.check_every if stop_ids or stop is not None else max_new_tokens  # no rule: no reads on the way
        made = 1
        while True:
            if made == max_new_tokens or made % every == 0:
                self._check_stops(out[: len(prompts), :made].tolist(), ends, checked, stop_ids, stop)
                if made == max_new_tokens or all(e is not None for e in ends):
                    break
            if self.noise is not None:
                self._draw_noise(generator)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step_fn()
            out[:, made] = self.tokens[:, 0]
            if logps is not None and self.chosen_logps is not None:
                logps[:, made] = self.chosen_logps
            made += 1
        self.logps = None if logps is None else logps[: len(prompts), :made]
        new = out[: len(prompts), :made].tolist()
        return [row if end is None else row[:end] for row, end in zip(new, ends)]

    @staticmethod
    def _check_stops(
        new: list[list[int]],
        ends: list[int | None],
        checked: list[int],
        stop_ids: Collection[int],
        stop: Callable[[list[int]], bool] | None,
    ) -> None:
        for row, tokens in enumerate(new):
            if ends[row] is None:
                ends[row] = stop_length(tokens, checked[row], stop_ids, stop)
                checked[row] = len(tokens)
