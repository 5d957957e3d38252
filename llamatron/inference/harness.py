"""lm-evaluation-harness's `LM` interface over a llamatron model: log-likelihoods and greedy continuations.

lm-eval hands over text; its `TemplateLM` splits each (context, continuation) pair into tokens the way its own
Hugging Face adapter (`HFLM`) does, and this class scores them: requests sorted longest first (lm-eval's
`Collator`), cut into batches, right-padded, one forward per batch. Causal attention keeps a row's real
tokens blind to the padding after them, so each row's continuation is read from its own positions, and the
numbers equal HFLM's on the same model exported to Hugging Face (tests/test_eval_harness.py).
`loglikelihood_rolling` cuts a text into the windows lm-eval's `get_rolling_token_windows` defines (every
token scored once, each window as much context as fits) and batches the windows the same way.

Importing this module imports lm_eval (the `eval` extra); callers import it where they need it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from ..data.tokenizer import Tokenizer
from ..errors import DataError
from ..models import Transformer
from .generate import StopStrings, generate_batch

# (request key for the cache, context tokens, continuation tokens): what TemplateLM hands _loglikelihood_tokens
TokenRequest = tuple[Any, list[int], list[int]]


def continue_greedily(
    model: Transformer,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    stop_strings: Sequence[str],
    decode: Callable[[list[int]], str],
) -> list[list[int]]:
    """The greedy continuation of each prompt: at most max_new_tokens, ending after a token of `stop_ids` or once
    the decoded continuation holds a stop string. The one place evaluation decodes: the prompts together, through
    the batched decoder (inference/decode.py)."""
    stop = StopStrings(decode, [s for s in stop_strings if s]) if any(stop_strings) else None
    return generate_batch(model, prompts, max_new_tokens, stop_ids=stop_ids, stop=stop)


class LlamatronLM(TemplateLM):
    """A llamatron model (one device) as lm-eval's LM. batch_size: sequences per forward.

    data_parallel: every process of the default process group holds the same whole model; lm-eval then gives each
    its share of the requests and gathers the metrics on rank 0 (these collectives are the ones it asks for)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        batch_size: int = 8,
        add_bos_token: bool | None = None,
        data_parallel: bool = False,
    ):
        super().__init__()
        if tokenizer.eod_id is None:
            raise ValueError(f"tokenizer {tokenizer.source} has no end-of-sequence token; lm-eval needs one")
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.add_bos = tokenizer.adds_bos if add_bos_token is None else add_bos_token
        self._device = next(model.parameters()).device
        self._told_greedy = False
        if data_parallel and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor, concatenated along dim 0 (0-d tensors stacked), as accelerate's gather."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def eot_token_id(self) -> int:
        assert self.tok.eod_id is not None
        return self.tok.eod_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS where the tokenizer has one, else EOS (as HFLM)."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.cfg.max_seq_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.source.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As HFLM: the tokenizer's BOS unless told otherwise or the text already starts with it."""
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self.tok.bos_id is not None:
            bos = bos and not string.startswith(self.tok.decode([self.tok.bos_id]))
        ids = self.tok.encode(string)
        return [self.tok.bos_id, *ids] if bos and self.tok.bos_id is not None else ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    @torch.no_grad()
    def _score_batch(self, batch: list[TokenRequest]) -> list[tuple[float, bool]]:
        """One forward over the batch, right-padded: each continuation's log-probability and whether greedy
        decoding would produce it. A sequence longer than the context loses tokens from the left."""
        window = self.max_length
        longest_continuation = max(len(cont) for _, _, cont in batch)
        if longest_continuation > window:
            raise DataError(
                f"an lm-eval request scores a continuation of {longest_continuation} tokens, longer than the model's "
                f"context of {window}: this task does not fit the model"
            )
        inputs = [(ctx + cont)[-(window + 1) :][:-1] for _, ctx, cont in batch]
        longest = max(len(x) for x in inputs)
        ids = torch.zeros(len(batch), longest, dtype=torch.long, device=self._device)
        for row, x in enumerate(inputs):
            ids[row, : len(x)] = torch.tensor(x, dtype=torch.long)
        logprobs = F.log_softmax(self.model(ids).float(), dim=-1)
        out = []
        for row, ((_, _, cont), x) in enumerate(zip(batch, inputs)):
            # the logits at position i predict token i + 1: the continuation's come from its last len(cont)
            # input positions (the last input token is the one before the continuation's last)
            scored = logprobs[row, len(x) - len(cont) : len(x)]
            target = torch.tensor(cont, dtype=torch.long, device=self._device)
            total = float(scored.gather(-1, target[:, None]).sum())
            out.append((total, bool((scored.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs):
        """Longest first (lm-eval's Collator), in batches of batch_size; results in the requests' order."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            for req, answer in zip(chunk, self._score_batch(chunk)):
                results.append(answer)
                if req[0] is not None:  # a rolling window has no key of its own (cached per text below)
                    self.cache_hook.add_partial("loglikelihood", req[0], answer)
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability given the prefix token, in lm-eval's disjoint windows of the context."""
        windows: list[TokenRequest] = []
        counts = []
        for (text,) in (req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            these = [(None, *lm_utils.make_disjoint_window(w)) for w in rolling]
            windows += these
            counts.append(len(these))
        scores = self._loglikelihood_tokens(windows)
        totals, start = [], 0
        for req, n in zip(requests, counts):
            totals.append(sum(s for s, _ in scores[start : start + n]))
            start += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations up to each request's stop strings (and EOS) or max_gen_toks; the context is cut
        from the left to leave room for them. Requests with the same generation settings go together, longest
        first, batch_size at a time (as HFLM groups them)."""
        eos = self.tok_decode([self.eot_token_id])
        args = [req.args for req in requests]
        order = Collator(
            args, sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]), group_by="gen_kwargs", group_fn=lambda a: a[1]
        )
        out = []
        for chunk in order.get_batched(n=self.batch_size):
            kwargs = normalize_gen_kwargs(chunk[0][1], 256)
            if kwargs.get("do_sample") and not self._told_greedy and self.rank == 0:
                print(f"llamatron eval: a task asks to sample ({chunk[0][1]}); decoding greedily", file=sys.stderr)
                self._told_greedy = True
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = min(int(kwargs["max_gen_toks"]), self.max_length - 1)
            prompts = [
                self.tok_encode(context)[-(self.max_length - max_new) :] or [self.prefix_token_id]
                for context, _ in chunk
            ]
            continuations = continue_greedily(self.model, prompts, max_new, {self.eot_token_id}, until, self.tok.decode)
            for (context, gen_kwargs), ids in zip(chunk, continuations):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return order.get_original(out)
