"""GRPO's steps: sample completions with the run's own decoder on the current training weights, score them, and
train on them (objectives/grpo.py's loss).

Every --num-iterations steps a new batch of rollouts: the step's --global-batch-size / G prompts (G =
--num-generations), in a fixed shuffled order of the prompts file, each data-parallel rank taking its contiguous
share; each of its prompts sampled G times by inference/decode.Decoder on this rank's chunk as it trains (under
tensor parallelism every rank of the group decodes the same rows on its shard; no second copy of the model), in eval
mode, with the log-probability of every drawn token kept (the behaviour log-probabilities). The sampling seed is a
function of --seed, the rollout batch and the data-parallel rank, so a resumed run samples what the uninterrupted
one did. The rewards of every completion are gathered from all data-parallel ranks, so that the advantages (and
--scale-rewards batch) and the logged statistics are the whole batch's. The rollouts then train for
--num-iterations optimizer steps; with --beta > 0 the reference log-probabilities (LoRA's base, adapters off) are
computed once per batch of rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..adapters.lora import adapters_off
from ..data.prompts import Prompts
from ..inference.decode import Decoder
from ..inference.sampling import Sampling
from ..inference.stops import StopStrings
from ..models import IGNORE_INDEX
from ..objectives.grpo import GRPOObjective, group_advantages
from ..objectives.rewards import Reward, score
from ..parallel.mesh import Mesh
from .engine import Engine, train_step
from .metrics import sync_device

SHOWN_COMPLETIONS = 4  # sampled completions a record shows (--log-completions-every)


_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k as unsigned 64-bit (torch's >> on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(value: int) -> int:
    """splitmix64's finaliser of a non-negative integer, as a signed 64-bit value."""
    x = (value + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return _signed(x ^ (x >> 31))


def counter_noise(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Exp(1) draws (rows, vocab) that are a function of each row's key, the step and the token alone (splitmix64
    of their combination): a row samples the same tokens in any batch, on any rank, in any layout."""
    token = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = keys[:, None] + _signed((step + 1) * 0x9E3779B97F4A7C15 & _M64) + token * _signed(0xD1B54A32D192ED03)
    x = (x ^ _shift(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift(x, 31)
    uniform = (_shift(x, 11).double() + 0.5) * 2.0**-53  # in (0, 1)
    return -torch.log(uniform)


class RowKeyedDecoder(Decoder):
    """The decoder with each row's sampling noise keyed by the row (counter_noise), not drawn from one stream."""

    keys: torch.Tensor  # (batch,) int64, set before generate
    made = 0

    def _draw_noise(self, generator: torch.Generator) -> None:
        assert self.noise is not None
        self.noise.copy_(counter_noise(self.keys, self.made, self.noise.shape[1]))
        self.made += 1


@dataclass
class Rollouts:
    """One batch of rollouts as this rank trains on it, and the record fields it contributes."""

    micro_batches: list[dict[str, torch.Tensor]]
    fields: dict[str, Any]
    shown: list[dict[str, Any]]


class GRPOSteps:
    """Runs GRPO's optimizer steps for the Trainer (see the module docstring)."""

    def __init__(self, engine: Engine, prompts: Prompts, rewards: list[Reward], weights: list[float], tokenizer):
        self.engine, self.prompts, self.rewards, self.tokenizer = engine, prompts, rewards, tokenizer
        self.weights = torch.tensor(weights or [1.0] * len(rewards))
        ob = engine.cfg.objective
        self.ob, self.group = ob, ob.num_generations
        self.order = np.random.RandomState(engine.cfg.train.seed).permutation(len(prompts.ids))
        # the tokenizer's end of sequence, and a chat format's end of turn for conversational prompts
        self.stop_ids = tuple(i for i in (tokenizer.eod_id, prompts.end_of_turn_id) if i is not None)
        strings = [*ob.stop_strings, *([prompts.end_of_turn] if prompts.end_of_turn else [])]
        self.stop = StopStrings(tokenizer.decode, strings) if strings else None
        self.current: Rollouts | None = None
        # one decoder for the run (on GPU its step is captured once): every prompt and completion fits its length
        self.length = max(len(p) for p in prompts.ids) + ob.max_completion_length
        self.decoder: RowKeyedDecoder | None = None

    def __call__(self, step: int, size: int) -> dict[str, Any]:
        """Optimizer step `step` (1-based) on a global batch of `size` completions: train_step's output, with the
        rollouts' record fields under "extra"."""
        index = (step - 1) // self.ob.num_iterations
        if self.current is None or (step - 1) % self.ob.num_iterations == 0:
            self.current = self._rollouts(index, size)
        start = time.perf_counter()
        out: dict[str, Any] = dict(train_step(self.engine, self.current.micro_batches, step - 1))
        sync_device(self.engine.device)
        seconds = time.perf_counter() - start
        trained = sum(mb["input_ids"].numel() for mb in self.current.micro_batches)
        extra = dict(self.current.fields)
        extra["train_tokens_per_sec"] = trained * self.engine.mesh.layout.dp / max(seconds, 1e-9)
        every = self.ob.log_completions_every
        if every and step % every == 0:
            extra["completions"] = self.current.shown
        out["extra"] = extra
        return out

    def _my_prompts(self, index: int, size: int) -> list[int]:
        """This data-parallel rank's prompts (record indices) of rollout batch `index`."""
        per_step, mesh = size // self.group, self.engine.mesh
        mine = per_step // mesh.layout.dp
        first = index * per_step + mesh.dp_rank * mine
        return [int(self.order[(first + j) % len(self.order)]) for j in range(mine)]

    def _rollouts(self, index: int, size: int) -> Rollouts:
        engine, mesh = self.engine, self.engine.mesh
        records = self._my_prompts(index, size)
        rows = [r for r in records for _ in range(self.group)]  # a prompt's G completions adjacent
        prompt_ids = [self.prompts.ids[r] for r in rows]
        start = time.perf_counter()
        completions, behaviour, ended = self._sample(prompt_ids, index)
        sync_device(engine.device)
        rollout_seconds = time.perf_counter() - start
        texts = [self.tokenizer.decode(c) for c in completions]
        if self.stop is not None:
            texts = [self.stop.cut(t) for t in texts]
        # a conversational prompt's completion reaches the rewards as TRL gives it: [{"role": "assistant", ...}]
        prompts = [self.prompts.records[r]["prompt"] for r in rows]
        values = score(
            self.rewards,
            prompts,
            [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(prompts, texts)],
            completions,
            [self.prompts.records[r] for r in rows],
            [self.prompts.lines[r] for r in rows],
        )
        local = torch.tensor([*values, [len(c) for c in completions], [float(not e) for e in ended]])
        every = _gathered(local, mesh, engine.device)  # (rewards + 2, all completions), data-parallel ranks in order
        combined = (every[: len(self.rewards)] * self.weights[:, None]).sum(0)
        advantages = group_advantages(combined, self.group, self.ob.scale_rewards)
        mine = advantages.view(mesh.layout.dp, -1)[mesh.dp_rank]
        truncated = local[-1].bool()
        mbs = self._micro_batches(prompt_ids, completions, behaviour, mine, truncated)
        fields = self._fields(every, combined, rollout_seconds)
        shown = [
            {"prompt": self.prompts.records[r]["prompt"], "completion": t, "reward": float(v)}
            for r, t, v in list(zip(rows, texts, combined[: len(rows)]))[:SHOWN_COMPLETIONS]
        ]
        return Rollouts(mbs, fields, shown)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[list[int]], index: int) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        """(each row's completion tokens, their behaviour log-probabilities, whether it ended before the limit)."""
        engine, ob = self.engine, self.ob
        model = engine.chunks[0]
        if self.decoder is None:  # every batch of rollouts has the same rows (no --rampup-batch-size)
            sampling = Sampling(temperature=ob.temperature, top_p=ob.top_p)
            self.decoder = RowKeyedDecoder(model, len(prompt_ids), self.length, sampling, record_logps=True)
        decoder = self.decoder
        decoder.made = 0
        # each row's key: the seed, the batch of rollouts and the row's place in the whole batch (not the rank's)
        first = engine.mesh.dp_rank * len(prompt_ids)
        decoder.keys = torch.tensor(
            [_mix(_mix(_mix(engine.cfg.train.seed) + index) + first + i) for i in range(len(prompt_ids))],
            device=engine.device,
        )
        was_training = model.training
        model.eval()
        try:
            completions = decoder.generate(prompt_ids, ob.max_completion_length, 0, self.stop_ids, self.stop)
        finally:
            model.train(was_training)
        assert decoder.logps is not None
        logps = decoder.logps.float().cpu()
        behaviour = [logps[i, : len(c)].tolist() for i, c in enumerate(completions)]
        ended = [
            len(c) < ob.max_completion_length or c[-1] in self.stop_ids or (self.stop is not None and self.stop(c))
            for c in completions
        ]
        return completions, behaviour, ended

    def _micro_batches(
        self,
        prompt_ids: list[list[int]],
        completions: list[list[int]],
        behaviour: list[list[float]],
        advantages: torch.Tensor,
        truncated: torch.Tensor,
    ) -> list[dict[str, torch.Tensor]]:
        """This rank's rollouts as micro-batches of --seq-length positions: prompt and completion, labels on the
        completion only (none on a truncated one with --mask-truncated-completions), behaviour log-probabilities
        at the positions predicting each completion token."""
        engine = self.engine
        seq, rows = engine.cfg.data.seq_length, len(prompt_ids)
        input_ids = torch.zeros(rows, seq, dtype=torch.long)
        labels = torch.full((rows, seq), IGNORE_INDEX, dtype=torch.long)
        old = torch.zeros(rows, seq)
        for i, (p, c, lp) in enumerate(zip(prompt_ids, completions, behaviour)):
            tokens = torch.tensor(p + c)[: seq + 1]
            input_ids[i, : len(tokens) - 1] = tokens[:-1]
            if self.ob.mask_truncated_completions and truncated[i]:
                continue
            span = slice(len(p) - 1, len(p) - 1 + len(c))
            labels[i, span] = torch.tensor(c)
            old[i, span] = torch.tensor(lp)
        micro = engine.cfg.train.micro_batch_size
        out = []
        for s in range(0, rows, micro):
            mb = {
                "input_ids": input_ids[s : s + micro],
                "labels": labels[s : s + micro],
                "old_logps": old[s : s + micro],
                "advantages": advantages[s : s + micro].float(),
            }
            out.append({k: v.to(engine.device) for k, v in mb.items()})
        if self.ob.beta > 0:
            self._reference(out)
        return out

    @torch.no_grad()
    def _reference(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Each micro-batch's reference log-probabilities: LoRA's base (adapters off), in eval mode."""
        model, objective = self.engine.chunks[0], self.engine.objective
        assert isinstance(objective, GRPOObjective)
        was_training = model.training
        model.eval()
        try:
            with adapters_off(self.engine.chunks):
                for mb in micro_batches:
                    mb["ref_logps"] = objective.token_logps(model(mb["input_ids"]), mb["labels"])
        finally:
            model.train(was_training)

    def _fields(self, every: torch.Tensor, combined: torch.Tensor, rollout_seconds: float) -> dict[str, Any]:
        """The rollouts' record fields (TRL's names where it has one): each reward's mean and std, the combined
        reward's, the share of groups whose rewards are all equal, completion lengths, the truncated share, and
        the decoder's speed."""
        out: dict[str, Any] = {}
        for reward, values in zip(self.rewards, every):
            out[f"rewards/{reward.name}/mean"] = values.mean().item()
            out[f"rewards/{reward.name}/std"] = values.std().item()
        out["reward"], out["reward_std"] = combined.mean().item(), combined.std().item()
        grouped = combined.view(-1, self.group)
        out["frac_reward_zero_std"] = (grouped == grouped[:, :1]).all(1).float().mean().item()
        lengths = every[len(self.rewards)]
        out["completions/mean_length"] = lengths.mean().item()
        out["completions/max_length"] = lengths.max().item()
        out["completions/clipped_ratio"] = every[-1].mean().item()
        out["rollout_tokens_per_sec"] = lengths.sum().item() / max(rollout_seconds, 1e-9)
        return out


def _gathered(local: torch.Tensor, mesh: Mesh, device: torch.device) -> torch.Tensor:
    """(fields, completions) of every data-parallel rank, concatenated in rank order along the completions."""
    if mesh.layout.dp == 1:
        return local
    on_device = local.to(device)  # NCCL gathers device tensors
    parts = [torch.empty_like(on_device) for _ in range(mesh.layout.dp)]
    dist.all_gather(parts, on_device, group=mesh.dp_group)
    return torch.cat(parts, dim=1).cpu()
