"""One layer-input type (models/layer_input.py): every decoder layer is called `layer(x, LayerInput)`, and what wraps
a layer keeps working with it: full recompute (its tensors saved for backward as tensor arguments), torch.compile of
each layer (no graph break, no recompilation for the next forward's new LayerInput) and a decoding step."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from llamatron.kernels.cross_entropy_op import cross_entropy_per_token
from llamatron.models import build_model, get_preset, materialize
from llamatron.models.layer_input import LayerInput
from llamatron.training.engine import apply_compile, apply_recompute


def _model(name: str, recompute: str | None = None, compiled: bool = False):
    cfg = get_preset(name)
    model = build_model(cfg)
    materialize(model, cfg, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    if recompute is not None:
        apply_recompute(model, recompute, None)
    if compiled:
        apply_compile(model)
    return model


def _grads(model, tokens: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    cross_entropy_per_token(model(tokens, position_ids=positions), tokens).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_layers_under_full_recompute_take_each_forward_s_layer_input():
    """Two steps at other positions: the same gradients as the eager model, no graph break, and the second step
    compiles nothing new (the LayerInput is guarded by its fields, not by the object)."""
    eager, compiled = _model("llama-test"), _model("llama-test", "full", compiled=True)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    counters.clear()
    graphs = None
    for start in (0, 5):
        positions = torch.arange(start, start + 16).expand(2, 16)
        want, got = _grads(eager, tokens, positions), _grads(compiled, tokens, positions)
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("name", ["llama4-test", "deepseek-v3-test", "falcon-test", "qwen3-test"])
def test_full_recompute_saves_the_layer_input_s_tensors_and_matches(name):
    """Full recompute hands the LayerInput's tensors to the checkpoint as tensor arguments: they are saved for
    backward (a saved-tensor hook sees them, as the planner's measurement reads), and the gradients are the plain
    model's (Llama 4's temperature tuning reads the positions, DeepSeek-V3's MLA its own rotary width)."""
    plain, recomputed = _model(name), _model(name, "full")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.add(t.untyped_storage().data_ptr())
        return t

    captured: list[LayerInput] = []
    first = next(iter(recomputed.layers.values()))
    first.register_forward_pre_hook(lambda _m, args: captured.append(args[1]))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _grads(recomputed, tokens, positions)
    want = _grads(plain, tokens, positions)
    assert {t.untyped_storage().data_ptr() for t in captured[0].tensors() if t is not None} <= seen
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)


def test_a_compiled_decoding_step_builds_its_layer_inputs_in_one_graph(monkeypatch):
    """The decoding step (inference/decode.py, the one a CUDA graph captures on GPU) builds every layer's LayerInput
    from its own tensors: compiled whole (dynamo's eager backend: the graph, not the kernels, is the question) it is
    one graph without a break, and gives the eager step's tokens."""
    from llamatron.inference.decode import Decoder

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    model = _model("llama-test")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    want = Decoder(model, 2, 24).generate(prompts, 10)
    counters.clear()
    assert Decoder(model, 2, 24, compile=True).generate(prompts, 10) == want
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
