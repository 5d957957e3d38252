"""LoRA under parallel layouts equals the single process (fp32, gloo): per-step loss and grad norm, with every
linear adapted. Tensor parallelism splits the adapters with their linear (tp 4 on 2 KV heads: replicated K/V rows
and their B rows); pipelines adapt each stage's layers; the distributed optimizer holds the adapters only."""

from __future__ import annotations

import pytest
from layout import assert_matches, run_train

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear", "--lr", "1e-2"]
# name -> (flags, processes, model)
LAYOUTS = {
    "pp2-vpp2-dp2-distopt": (
        ["--pp", "2", "--vpp", "2", "--micro-batch-size", "1", "--distributed-optimizer"],
        4,
        "llama-test4",
    ),
    "tp2-sp-cp2": (["--tp", "2", "--sequence-parallel", "--cp", "2"], 4, "llama-test4"),
    "tp4": (["--tp", "4"], 4, "llama-test4"),
    "ep2": (["--ep", "2"], 2, "mixtral-test4"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(model: str) -> list[dict]:
        if model not in cache:
            cache[model] = run_train(LORA, 1, tmp_path_factory.mktemp(f"lora-{model}"), model=model)
        return cache[model]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, reference, tmp_path):
    flags, nproc, model = LAYOUTS[name]
    stdout: list[str] = []
    assert_matches(reference(model), run_train([*LORA, *flags], nproc, tmp_path, model=model, stdout=stdout))
    if name == "pp2-vpp2-dp2-distopt":
        _check_startup_summary(stdout[0], model)


def _check_startup_summary(stdout: str, model: str) -> None:
    """The summary train prints once (rank 0) at its start: the model's parameters and layers as transformers counts
    them, the layout as given (4 processes: pp 2 x dp 2), and what LoRA trains in peft's own words."""
    import contextlib
    import io

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from llamatron.interop.hf import config_to_hf
    from llamatron.models import get_preset

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_to_hf(get_preset(model))))
    model_line = f"model: {model}, {hf.num_parameters():,} parameters"
    layers = f"{hf.config.num_hidden_layers} layers"
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        adapted = peft.get_peft_model(hf, lora)
        adapted.print_trainable_parameters()
    targets = ",".join(sorted(adapted.peft_config["default"].target_modules))  # all-linear, as peft resolves it
    lines = stdout.splitlines()
    assert sum(line.startswith("model: ") for line in lines) == 1, stdout  # rank 0 alone
    start = next(i for i, line in enumerate(lines) if line.startswith("model: "))
    assert lines[start].startswith(model_line) and lines[start].endswith(layers), lines[start]
    layout = "layout: 4 processes, tp 1 x pp 2 (vpp 2) x cp 1 x dp 2, ep 1; fsdp off, distributed optimizer on"
    assert lines[start + 1].startswith(layout), lines[start + 1]
    assert lines[start + 2].startswith(f"LoRA: rank 4, alpha 8, targets {targets} "), lines[start + 2]
    assert lines[start + 3] == printed.getvalue().strip(), (lines[start + 3], printed.getvalue())
