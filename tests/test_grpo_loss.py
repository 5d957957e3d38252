"""GRPO's loss and advantages against TRL 1.16's GRPOTrainer (objectives/grpo.py).

The loss: TRL's own GRPOTrainer._compute_loss, called as a function on a stand-in for the trainer that holds the
settings it reads and returns our log-probabilities from its model call, on the same completions, advantages,
behaviour and reference log-probabilities; summed over its gradient-accumulation micro-batches it is the step's
loss, which GRPOObjective computes from the logits. The advantages: TRL's formula (grpo_trainer.py,
_generate_and_score_completions, "sum_then_normalize": rewards less the group mean, divided by the group's or the
batch's nanstd + 1e-4) written out with its own nanstd.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llamatron.kernels.cross_entropy_op import reference_cross_entropy
from llamatron.models import IGNORE_INDEX
from llamatron.objectives.grpo import GRPOObjective, GRPOSettings, group_advantages
from llamatron.parallel.mesh import Mesh

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

VOCAB, PROMPT, COMPLETION, ROWS, MICRO = 11, 3, 6, 8, 2


def _trl_trainer(s: GRPOSettings, logps: torch.Tensor, accumulation: int) -> SimpleNamespace:
    """What GRPOTrainer._compute_loss reads of its trainer (no vLLM, no entropy mask or bonus, no off-policy mask,
    one process)."""
    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x
    )
    rows = iter(logps.split(ROWS // MICRO))
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (next(rows), torch.zeros(ROWS // MICRO, COMPLETION), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=s.importance_sampling_level,
        beta=s.beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
        loss_type=s.loss_type,
        epsilon_low=s.epsilon,
        epsilon_high=s.high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=s.max_completion_length,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, PROMPT + COMPLETION, VOCAB, generator=g)
    completion = torch.randint(0, VOCAB, (ROWS, COMPLETION), generator=g)
    lengths = torch.randint(1, COMPLETION + 1, (ROWS,), generator=g)
    lengths[3] = 0  # a completion masked whole (--mask-truncated-completions)
    cmask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    old = torch.randn(ROWS, COMPLETION, generator=g) * 0.3 - 2.0
    ref = torch.randn(ROWS, COMPLETION, generator=g) * 0.3 - 2.0
    adv = torch.randn(ROWS, generator=g)
    return logits, completion, cmask, old, ref, adv


def _positions(x: torch.Tensor, cmask: torch.Tensor, fill: float | int) -> torch.Tensor:
    """Completion-aligned values at the positions predicting them (llamatron's labels: position p predicts p+1)."""
    out = torch.full((ROWS, PROMPT + COMPLETION), fill, dtype=x.dtype)
    out[:, PROMPT - 1 : PROMPT - 1 + COMPLETION] = torch.where(cmask.bool(), x, torch.full_like(x, fill))
    return out


SETTINGS = [
    GRPOSettings(loss, 0.2, high, beta, level, max_completion_length=8, temperature=0.7)
    for loss, level, beta, high in itertools.product(
        ("grpo", "dapo", "dr_grpo", "bnpo"), ("token", "sequence"), (0.0, 0.04), (None, 0.28)
    )
]


@pytest.mark.parametrize(
    "s", SETTINGS, ids=lambda s: f"{s.loss_type}-{s.importance_sampling_level}-b{s.beta}-h{s.high}"
)
def test_loss_and_gradient_match_trl(s: GRPOSettings):
    logits, completion, cmask, old, ref, adv = _case(0)
    # the policy's log-probabilities: close to the behaviour's, so that some ratios clip and some do not
    logits = logits.requires_grad_()
    labels = _positions(completion, cmask, IGNORE_INDEX)
    mbs = [
        {
            "input_ids": torch.zeros(ROWS // MICRO, PROMPT + COMPLETION, dtype=torch.long),
            "labels": labels.split(ROWS // MICRO)[i],
            "old_logps": _positions(old, cmask, 0.0).split(ROWS // MICRO)[i],
            "ref_logps": _positions(ref, cmask, 0.0).split(ROWS // MICRO)[i],
            "advantages": adv.split(ROWS // MICRO)[i],
        }
        for i in range(MICRO)
    ]
    ours = GRPOObjective(reference_cross_entropy, Mesh(), torch.device("cpu"), s)
    normaliser = ours.normaliser(mbs)
    ours.begin_step(ROWS, None)
    loss = sum(ours.loss(lg, mb, normaliser) for lg, mb in zip(logits.split(ROWS // MICRO), mbs))
    (grad,) = torch.autograd.grad(loss, logits)

    # TRL's: the same log-probabilities of logits / temperature, from a copy of the logits
    theirs_logits = logits.detach().clone().requires_grad_()
    window = theirs_logits[:, PROMPT - 1 : PROMPT - 1 + COMPLETION] / s.temperature
    logps = torch.log_softmax(window, -1).gather(-1, completion[..., None]).squeeze(-1)
    trainer = _trl_trainer(s, logps, MICRO)
    items = cmask.sum()
    trl_loss = sum(
        trl_grpo.GRPOTrainer._compute_loss(
            trainer,
            None,
            {
                "prompt_ids": torch.zeros(ROWS // MICRO, PROMPT, dtype=torch.long),
                "prompt_mask": torch.ones(ROWS // MICRO, PROMPT, dtype=torch.long),
                "completion_ids": c,
                "completion_mask": m,
                "advantages": a,
                "old_per_token_logps": o,
                "ref_per_token_logps": r,
                "num_items_in_batch": items,
            },
        )
        for c, m, a, o, r in zip(
            *(t.split(ROWS // MICRO) for t in (completion, cmask, adv, old, ref)),
        )
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, theirs_logits)
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=1e-6)
    # the logged statistics: TRL's clip_ratio/* means and kl, over the step
    fields = ours.stat_fields(ours.step_stats(ours.local_stats(), ROWS).tolist())
    metrics = trainer._metrics["train"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        if name == "kl" and s.beta == 0:
            assert "kl" not in fields
            continue
        trl_value = _pooled(metrics[name], [m.sum().item() for m in cmask.split(ROWS // MICRO)], s, name)
        assert fields[name] == pytest.approx(trl_value, rel=1e-6, abs=1e-6), name
    assert 0 < fields["clip_ratio/region_mean"] < 1  # the case clips some ratios, not all


def _pooled(means: list[float], tokens: list[float], s: GRPOSettings, name: str) -> float:
    """TRL logs each micro-batch's masked mean; ours pools the step: weight them by what each counted (tokens;
    a sequence-level ratio's clipping: completions)."""
    by_rows = s.importance_sampling_level == "sequence" and name != "kl"
    weights = [ROWS // MICRO] * MICRO if by_rows else tokens
    return sum(m * w for m, w in zip(means, weights)) / sum(weights)


@pytest.mark.parametrize("scale", ("group", "batch", "none"))
def test_group_advantages_match_trl(scale: str):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, generator=g)
    rewards[4:8] = 0.5  # a group whose rewards are all equal: advantage 0
    group = 4
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = trl_utils.nanstd(rewards).expand_as(rewards)
    else:
        std = trl_utils.nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, group, scale), expected, rtol=0, atol=1e-6)
    assert group_advantages(rewards, group, scale)[4:8].abs().max() == 0
