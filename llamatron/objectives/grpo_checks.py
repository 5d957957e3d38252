"""--objective grpo's settings against the rest of the run, checked before any memory is spent (one line each):
its flags, the layouts its rollouts can decode in, the prompts file and the rewards."""

from __future__ import annotations

from ..config.settings import RunConfig
from ..data.prompts import Prompts, encode_prompts, read_prompt_records
from ..data.tokenizer import load_tokenizer
from ..errors import ConfigError
from .rewards import Reward, load_rewards

_GRPO_FLAGS = (
    "prompts",
    "reward",
    "reward_weights",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "stop_strings",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "beta",
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "mask_truncated_completions",
    "log_completions_every",
)


def grpo_problems(cfg: RunConfig, dp: int) -> list[str]:
    """What --objective grpo cannot run with (its settings, given to another objective: named too)."""
    ob, p, d, t = cfg.objective, cfg.parallel, cfg.data, cfg.train
    if ob.objective != "grpo":
        given = [f"--{k.replace('_', '-')}" for k in _GRPO_FLAGS if k in cfg.explicit]
        return [f"{', '.join(given)}: read by --objective grpo only; add it, or drop them"] if given else []
    problems = []
    if ob.prompts is None:
        problems.append('--objective grpo needs --prompts FILE.jsonl (records with a "prompt" text)')
    other = [f for f, given in (("--data", d.data), ("--sft-data", d.sft_data), ("--mock-data", d.mock_data),
                                ("--preference-data", d.preference_data)) if given]  # fmt: skip
    if other:
        problems.append(f"--objective grpo trains on its own rollouts of --prompts; drop {', '.join(other)}")
    if d.tokenizer is None:
        problems.append("--objective grpo needs --tokenizer (prompts are encoded and completions decoded with it)")
    layouts = [(p.pp > 1, "--pp"), (p.cp > 1, "--cp"), (p.ep > 1, "--ep"), (p.fsdp, "--fsdp"),
               (p.sequence_parallel, "--sequence-parallel")]  # fmt: skip
    for refused, flag in layouts:
        if refused:
            problems.append(
                f"--objective grpo: {flag} is not supported yet (the rollouts decode on the training weights in "
                "the run's layout: --tp and data parallelism do); drop it"
            )
    if t.rampup_batch_size:
        problems.append("--objective grpo: --rampup-batch-size is not supported (a batch of rollouts is whole groups)")
    if ob.beta > 0 and cfg.lora.lora_rank == 0:
        problems.append(
            "--objective grpo --beta > 0 needs LoRA (--lora-rank): the reference is the base with the adapters off "
            "(a frozen copy for full fine-tuning is not built yet); use --beta 0 or --lora-rank"
        )
    if t.save_interval and t.save_interval % ob.num_iterations:
        problems.append(
            f"--save-interval {t.save_interval} must be a multiple of --num-iterations {ob.num_iterations} (a "
            "checkpoint holds no rollouts: it is taken where a new batch of them starts)"
        )
    gbs, g = t.global_batch_size, ob.num_generations
    if gbs % (g * dp):
        problems.append(
            f"--objective grpo: --global-batch-size {gbs} (completions a step) must be a multiple of "
            f"--num-generations x data-parallel size = {g} x {dp} = {g * dp}"
        )
    return problems


def load_grpo_inputs(cfg: RunConfig, context: int) -> tuple[Prompts, list[Reward]]:
    """The rewards and the encoded prompts (ConfigError / DataError, one line, for bad ones): read at validation,
    before the model is built, and again by the run. context: the model's (the decoder's KV cache holds no more)."""
    ob = cfg.objective
    rewards = load_rewards(ob.reward, ob.reward_weights, ob.max_completion_length)
    needed = tuple(sorted({f for r in rewards for f in r.fields}))
    assert ob.prompts is not None and cfg.data.tokenizer is not None  # grpo_problems refused the run without
    records, lines = read_prompt_records(ob.prompts, needed)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    seq = cfg.data.seq_length
    room = (seq, f"--seq-length {seq}") if seq <= context else (context, f"the model's context of {context} tokens")
    prompts = encode_prompts(records, lines, tokenizer, ob.prompts, room, ob.max_completion_length)
    return prompts, rewards


def check_grpo(cfg: RunConfig, dp: int, context: int) -> None:
    """grpo_problems, then the prompts and rewards read (context: the model's)."""
    problems = grpo_problems(cfg, dp)
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.objective.objective == "grpo":
        load_grpo_inputs(cfg, context)
