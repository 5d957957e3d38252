"""The objective section of the settings (objectives/): which one a step minimises, and the settings of DPO and
GRPO. Each field is a flag and a YAML key, as every section's (config/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .ranges import Range, above, at_least
from .ranges import setting as _f

# --objective, --dpo-loss and GRPO's choices (objectives/: language_model.py, preference.py, grpo.py)
OBJECTIVES = ("lm", "dpo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo", "sigmoid_norm")
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")


@dataclass
class ObjectiveConfig:
    """What a step minimises (objectives/)."""

    objective: str = _f(
        "lm",
        "lm: next-token cross entropy (pre-training, --sft-data); dpo: direct preference optimisation on "
        "--preference-data against the starting weights as the reference (LoRA: the base, adapters off); grpo: "
        "group relative policy optimisation on completions sampled from --prompts, scored by --reward",
        OBJECTIVES,
    )
    dpo_beta: float = _f(0.1, "DPO's beta: how far the policy may move from the reference", allowed=above(0))
    dpo_loss: str = _f(
        "sigmoid",
        "sigmoid: DPO's; ipo: IPO's squared loss on per-token log-ratios; sigmoid_norm: DPO on per-token log-ratios",
        DPO_LOSSES,
    )
    prompts: str | None = _f(
        None,
        '--objective grpo: a JSONL file of records with a "prompt" (and the fields the rewards read, e.g. "answer")',
    )
    reward: list[str] = _f(
        [],
        "--objective grpo: the reward functions, summed with --reward-weights: built-in (exact_answer, format, "
        "length) or FILE.py:FUNCTION, called as TRL calls one (prompts=, completions=, the records' fields)",
    )
    reward_weights: list[float] = _f([], "one weight per --reward (default: 1 each)")
    num_generations: int = _f(8, "--objective grpo: completions sampled per prompt (a group)", allowed=at_least(2))
    max_completion_length: int = _f(64, "--objective grpo: new tokens per completion, at most", allowed=at_least(1))
    temperature: float = _f(1.0, "--objective grpo: sampling temperature", allowed=above(0))
    top_p: float = _f(1.0, "--objective grpo: nucleus sampling's p (1: no cut)", allowed=Range(0, 1, low_open=True))
    stop_strings: list[str] = _f([], "--objective grpo: a completion ends once it holds one of these")
    num_iterations: int = _f(
        1, "--objective grpo: optimizer steps on each batch of rollouts (TRL's num_iterations)", allowed=at_least(1)
    )
    epsilon: float = _f(
        0.2,
        "--objective grpo: the ratio's clip range below (and above, unless --epsilon-high)",
        allowed=Range(0, 1, low_open=True, high_open=True),
    )
    epsilon_high: float | None = _f(
        None, "--objective grpo: the clip range above (DAPO's clip-higher)", allowed=above(0)
    )
    beta: float = _f(
        0.0,
        "--objective grpo: weight of the KL term to the reference (LoRA: the base, adapters off)",
        allowed=at_least(0),
    )
    loss_type: str = _f("dapo", "--objective grpo: how the token losses are averaged (TRL's names)", GRPO_LOSSES)
    importance_sampling_level: str = _f(
        "token", "--objective grpo: token ratios, or sequence (GSPO: one ratio per completion)", ("token", "sequence")
    )
    scale_rewards: str = _f(
        "group",
        "--objective grpo: divide advantages by the group's or batch's reward std, or none",
        ("group", "batch", "none"),
    )
    mask_truncated_completions: bool = _f(False, "--objective grpo: no loss on completions cut by the length limit")
    log_completions_every: int = _f(
        0,
        "--objective grpo: write a few sampled completions to --metrics-file every N steps (0: never)",
        allowed=at_least(0, "0: never"),
    )
