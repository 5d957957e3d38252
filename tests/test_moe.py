"""The mixture-of-experts layer (models/moe.py) and its expert-parallel dispatch (parallel/expert.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import spawn

from llamatron.errors import ConfigError
from llamatron.models import build_model, get_preset, materialize
from llamatron.models.inventory import active_params, expert_params, flops_per_token, num_params
from llamatron.models.moe import MoE, router_losses
from llamatron.parallel.tensor_layers import gather_vocab


def _moe(seed: int = 0) -> MoE:
    cfg = get_preset("mixtral-test")
    torch.manual_seed(seed)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe


def _mixtral_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Mixtral's block written out token by token: softmax, top-k, renormalise, the chosen experts' weighted sum."""
    probs = torch.softmax(moe.router(x), -1)
    top, chosen = probs.topk(moe.top_k, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    e = moe.experts
    for t in range(x.shape[0]):
        for w, i in zip(top[t], chosen[t]):
            gate, up = F.linear(x[t], e.gate_up[i]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, e.down[i])
    return out


def test_moe_is_mixtral_routing_token_by_token():
    moe = _moe()
    x = torch.randn(1, 24, 64)
    assert torch.allclose(moe(x)[0], _mixtral_reference(moe, x[0]), atol=1e-5)


def test_router_losses_per_sequence():
    """Balanced routing scores k (= Mixtral's concatenated formula on one sequence); a router that sends every token
    to the same k experts scores E · k · (its mean probability of them); the z-loss is the mean squared logsumexp."""
    E, k, S = 4, 2, 8
    logits = torch.zeros(2 * S, E)  # uniform probabilities
    probs = torch.softmax(logits, -1)
    balanced = torch.tensor([[0, 1], [2, 3]] * S)  # every expert chosen S/2·... equally often
    aux, z = router_losses(logits, probs, balanced, 2, E)
    assert torch.allclose(aux, torch.full((2,), float(k)))
    assert torch.allclose(z, torch.full((2,), torch.logsumexp(torch.zeros(E), 0).item() ** 2))
    skewed = torch.tensor([[0, 1]] * (2 * S))
    aux, _ = router_losses(logits, probs, skewed, 2, E)
    assert torch.allclose(aux, torch.full((2,), E * (1 / E + 1 / E)))  # share 1 each for two experts of prob 1/E
    # per sequence: a sequence's score does not change with the other sequences of its micro-batch
    one, _ = router_losses(logits[:S], probs[:S], skewed[:S], 1, E)
    assert torch.allclose(one, aux[:1])


def test_moe_model_counts_its_parameters_and_active_flops():
    cfg = get_preset("mixtral-test")
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    dense_mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    per_layer_inactive = (cfg.num_experts - cfg.experts_per_token) * dense_mlp
    assert num_params(cfg) - active_params(cfg) == cfg.num_layers * per_layer_inactive
    assert expert_params(cfg) == cfg.num_layers * cfg.num_experts * dense_mlp
    keys = 6 * active_params(cfg) - 6 * cfg.vocab_size * cfg.hidden_size
    assert flops_per_token(cfg, 32) == keys + 12 * cfg.num_layers * cfg.hidden_size * 32
    big = get_preset("mixtral-8x7b")  # Mistral AI: 46.7B parameters, 12.9B active
    assert round(num_params(big) / 1e9, 1) == 46.7 and round(active_params(big) / 1e9, 1) == 12.9


def _skewed_dispatch(rank: int, world: int) -> None:
    """Expert parallelism over 2 gloo ranks against one process, with one expert taking every token's first
    choice and another none: outputs, input gradients and every weight gradient agree."""
    from llamatron.parallel.expert import ExpertParallelDispatch

    moe = _moe(seed=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 3.0  # x · 3·1: expert 0 wins for every token with a positive sum ...
        moe.router.weight[3] = -3.0  # ... and expert 3 loses for all of them
    gen = torch.Generator().manual_seed(7)
    x_all = (torch.randn(world, 2, 16, 64, generator=gen) + 0.5).requires_grad_()
    ref = torch.cat([moe(x_all[r]) for r in range(world)])
    (ref * torch.arange(ref.numel()).view_as(ref).sin()).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    ref_x_grad = x_all.grad[rank].clone()
    chosen = torch.softmax(moe.router(x_all.detach().reshape(-1, 64)), -1).topk(2, -1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    assert counts[0] == chosen.shape[0] and counts[3] == 0  # the skew the test is about

    local = 4 // world
    mine = slice(rank * local, (rank + 1) * local)
    moe.zero_grad()
    with torch.no_grad():
        gate_up, down = moe.experts.gate_up[mine].clone(), moe.experts.down[mine].clone()
    moe.experts.gate_up, moe.experts.down = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    moe.dispatch = ExpertParallelDispatch(torch.distributed.group.WORLD, world, local)
    x = x_all.detach()[rank].clone().requires_grad_()
    out = moe(x)
    assert torch.allclose(out, ref[2 * rank : 2 * rank + 2], atol=1e-6)
    weights = torch.arange(ref.numel()).view_as(ref).sin()[2 * rank : 2 * rank + 2]
    (out * weights).sum().backward()
    assert torch.allclose(x.grad, ref_x_grad, atol=1e-6)
    assert torch.allclose(moe.experts.gate_up.grad, ref_grads["experts.gate_up"][mine], atol=1e-6)
    assert torch.allclose(moe.experts.down.grad, ref_grads["experts.down"][mine], atol=1e-6)
    router_grad = moe.router.weight.grad.clone()
    torch.distributed.all_reduce(router_grad)  # each rank's share comes from its own tokens
    assert torch.allclose(router_grad, ref_grads["router.weight"], atol=1e-6)
    # backward sent the tokens' gradient home before computing the gate_up weight gradient, and waited after it
    assert moe.dispatch.events == ["input gradient sent", "weight gradient", "input gradient received"]


def test_expert_parallel_dispatch_is_exact_under_skewed_routing():
    """...and its backward overlaps the all-to-all of the tokens' gradient with the gate_up weight gradient."""
    spawn(_skewed_dispatch, 2)


def test_moe_trains_without_router_losses_outside_training():
    """A model built without the engine has no router-loss weight: its forward and backward are the plain MoE's."""
    cfg = get_preset("mixtral-test")
    model = materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model": "llama-test", "ep": 2}, "--ep 2 needs a mixture-of-experts model"),
        ({"ep": 3}, "num_experts 4 is not divisible by --ep 3"),
        ({"cp": 2}, "router losses are per sequence"),
        ({"model_overrides": {"experts_per_token": 5}}, "experts_per_token 5 must be in 1..num_experts"),
        ({"tp": 2, "etp": 3}, "--etp 3 must be 1 \\(whole experts\\) or the --tp size 2"),
        ({"tp": 2, "etp": 1}, "--etp 1 with --tp 2 routes each tp rank's sequence shard: add --sequence-parallel"),
        ({"tp": 2, "etp": 1, "sequence_parallel": True, "ep": 6}, r"not divisible by --ep 6 x --tp 2 \(--etp 1\); "),
        ({"model": "llama-test", "tp": 2, "etp": 1, "sequence_parallel": True}, "has none: drop --etp"),
    ],
)
def test_bad_moe_settings_are_one_line_errors(values, message):
    from llamatron.config.settings import config_from_values
    from llamatron.training.validate import validate

    cfg = config_from_values({"model": "mixtral-test", "mock_data": True, "device": "cpu", **values})
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, world_size=12)
    assert "\n" not in str(err.value)


def _split_moe_specs(mesh):
    """The first MoE layer's parameter specs of mixtral-test (on meta) split as training splits them."""
    from llamatron.parallel.expert import apply_expert_parallel
    from llamatron.parallel.tensor import apply_tensor_parallel

    with torch.device("meta"):
        model = build_model(get_preset("mixtral-test"))
    specs = apply_tensor_parallel(model, mesh, sequence_parallel=True)
    specs = apply_expert_parallel(model, mesh, True, specs)
    return model.layers["0"].mlp, {n.removeprefix("layers.0.mlp."): s for n, s in specs.items() if ".0.mlp." in n}


def test_etp_1_keeps_experts_whole_over_ep_x_tp_ranks():
    """ep 2 x tp 2 on mixtral-test's 4 experts (ffn 96): --etp 1 gives dp rank 1's tp rank 1 (expert rank 3) expert
    3 whole, routed from its own sequence shard; the default splits experts 2-3 along ffn over the tp ranks."""
    from llamatron.parallel.layout import ParallelLayout
    from llamatron.parallel.mesh import Mesh

    def mesh(etp):
        coords = dict(tp_rank=1, dp_rank=1)
        return Mesh(ParallelLayout(tp=2, dp=2, ep=2, etp=etp), **coords, expert_group="the 4 ranks' group")  # type: ignore[arg-type]  # never used on meta

    moe, specs = _split_moe_specs(mesh(1))
    up = specs["experts.gate_up"]
    assert (up.expert_shard, up.tp_layout, up.experts_over_tp) == ((3, 1), None, True)
    assert up.local_shape == moe.experts.gate_up.shape == (1, 2 * 96, 64)
    assert not up.partial_grad and up.split_over_tp and specs["router.weight"].partial_grad
    assert moe.shards.count == 2 and moe.dispatch.ep == 4 and moe.router_loss_share == 1.0

    moe, specs = _split_moe_specs(mesh(None))
    up = specs["experts.gate_up"]
    assert up.expert_shard == (2, 2) and up.tp_layout is not None and not up.experts_over_tp
    assert moe.experts.gate_up.shape == (2, 96, 64) and moe.shards.count == 1 and moe.dispatch.ep == 2


def test_ep_must_divide_the_data_parallel_size():
    from llamatron.parallel.layout import LayoutChoice

    assert "--ep 4 must divide the data-parallel size 2" in LayoutChoice(tp=2, ep=4).world_problems(4)[0]
    assert LayoutChoice(tp=2, ep=4).world_problems(8) == []


def test_fp8_converts_the_attention_and_experts_and_leaves_the_router_in_bf16():
    pytest.importorskip("torchao")  # the test extra installs it
    from llamatron.training.fp8 import apply_fp8, fp8_layers

    model = build_model(get_preset("mixtral-test"))
    apply_fp8(model, "tensorwise", emulate=True, experts=True)
    layer = model.layers["0"]
    assert type(layer.attn.qkv).__name__ == "Float8Linear"
    assert type(layer.mlp.router) is torch.nn.Linear  # its 4 outputs pick the experts
    assert "layers.0.mlp.experts" in fp8_layers(model)  # their grouped GEMMs: tests/test_fp8_experts.py


def _tp_logits(rank: int, world: int, checkpoint: str) -> None:
    from llamatron.inference.generate import load_for_generation
    from llamatron.parallel.layout import LayoutChoice
    from llamatron.parallel.mesh import build_mesh

    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 8]])
    sharded, _ = load_for_generation(checkpoint, mesh=build_mesh(LayoutChoice(tp=world)))
    whole, _ = load_for_generation(checkpoint)
    # each rank holds its 1/tp of every expert's ffn (not a whole copy)
    assert sharded.layers["0"].mlp.experts.gate_up.shape[1] == whole.layers["0"].mlp.experts.gate_up.shape[1] // world
    with torch.no_grad():
        assert (gather_vocab(sharded(ids), sharded.parallel.vocab) - whole(ids)).abs().max() < 1e-5


def test_tensor_parallel_generation_of_a_mixture_of_experts(tmp_path):
    """generate --tp loads a MoE checkpoint with every expert split along its ffn: the one-process logits."""
    from layout import run_train

    run_train(["--train-steps", "1", "--save", "ck"], 1, tmp_path, model="mixtral-test")
    spawn(_tp_logits, 2, str(tmp_path / "ck"))


@pytest.mark.parametrize("gather_sum", ["expression", "custom op"])
def test_the_permutations_gradients_equal_autograd_of_the_index_ops(gather_sum, monkeypatch):
    """moe.permute and moe.combine carry their own backward (gathers through the inverse permutation): values and
    gradients equal autograd's of the plain index ops (tokens[source], out[order] = rows, the weighted sum), fp64,
    under skewed routing with ties and an expert no token chose. "custom op": kernels_on standing in for CUDA, the
    combine and the permutation's backward run llamatron::gather_sum (its CPU kernel; the Triton kernel's own test
    is in test_triton_kernels.py)."""
    from llamatron.kernels import triton_check
    from llamatron.models.moe import combine, permute, route

    if gather_sum == "custom op":
        monkeypatch.setattr(triton_check, "kernels_on", lambda backend, x: backend != "torch")
        calls = []
        real = torch.ops.llamatron.gather_sum.default

        def counted(*args):
            calls.append(args[1].numel())
            return real(*args)

        monkeypatch.setattr("llamatron.kernels.gather_sum_op.gather_sum_op", counted)

    torch.manual_seed(0)
    tokens_n, hidden, k, experts = 37, 8, 3, 6
    chosen = torch.stack([torch.randperm(experts - 1)[:k] for _ in range(tokens_n)])  # expert 5: never chosen
    chosen[:10] = torch.tensor([0, 1, 2])  # skew
    routing = route(chosen, experts)
    assert routing.counts[experts - 1] == 0
    tokens = torch.randn(tokens_n, hidden, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(tokens_n, k, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(tokens_n * k, hidden, dtype=torch.float64)  # stands in for the experts
    grad_out = torch.randn(tokens_n, hidden, dtype=torch.float64)

    out = combine(permute(tokens, routing) * scale, routing, weights)
    ours = torch.autograd.grad(out, (tokens, weights), grad_out)
    rows = tokens[routing.order // k] * scale
    unsorted = torch.empty_like(rows)
    unsorted[routing.order] = rows
    ref_out = (unsorted.view(tokens_n, k, hidden) * weights.unsqueeze(-1)).sum(1)
    refs = torch.autograd.grad(ref_out, (tokens, weights), grad_out)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    for mine, ref in zip(ours, refs):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-12)
    if gather_sum == "custom op":
        assert calls == [tokens_n * k, tokens_n * k]  # the combine's forward, the permutation's backward
