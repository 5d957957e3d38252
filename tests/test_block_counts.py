"""The planner reads a block's and a final norm's activation terms from what they declare (models/block_counts.py),
as it reads its attention's: a family whose block declares other counts gets other figures (issue 49)."""

from __future__ import annotations

import dataclasses

import pytest

from llamatron.kernels.choices import KernelChoices
from llamatron.models import families
from llamatron.models.attention_counts import LayerKernels
from llamatron.models.blocks import DecoderBlock
from llamatron.models.families import get_preset
from llamatron.models.layers import RMSNorm
from llamatron.planning.activations import final_norm_bytes, layer_activation_terms
from llamatron.planning.layout import Precision
from llamatron.training.kernel_settings import kernel_problems


@dataclasses.dataclass(frozen=True)
class OddCounts:
    """A block's counts no formula of the planner gives: each term names its inputs."""

    rmsnorm_kernel: bool = False
    swiglu_kernel: bool = False

    def saved(
        self, act_bytes: int, ffn: float, tp: int, sequence_parallel: bool, kernels: LayerKernels
    ) -> dict[str, float]:
        return {"norm_inputs": 1000.0 + tp, "norm_outputs": 7.0 * act_bytes, "mlp": ffn + (3 if kernels.norms else 0)}


class OddBlock(DecoderBlock):
    @property
    def counts(self) -> OddCounts:  # type: ignore[override]
        return OddCounts()


@dataclasses.dataclass(frozen=True)
class OddNormCounts:
    def saved(self, act_bytes: int, tp: int, sequence_parallel: bool, fused_norms: bool) -> float:
        return 12345.0 + act_bytes


class OddNorm(RMSNorm):
    @property
    def counts(self) -> OddNormCounts:  # type: ignore[override]
        return OddNormCounts()


@pytest.fixture
def odd_model(monkeypatch):
    """llama-test's layers, but a family whose block and final norm declare OddCounts / OddNormCounts."""
    base = get_preset("llama-test")
    family = dataclasses.replace(
        families.get_family(base.family),
        name="odd",
        block=lambda cfg, i: OddBlock(cfg, i),
        final_norm=lambda cfg: OddNorm(cfg.hidden_size, cfg.norm_eps),
    )
    monkeypatch.setitem(families.FAMILIES, "odd", family)
    return dataclasses.replace(base, family="odd"), base


def test_planner_reads_the_blocks_declared_counts(odd_model):
    odd, base = odd_model
    terms = layer_activation_terms(odd, 2, tp=2, kernels=LayerKernels(norms=True))
    assert terms["norm_inputs"] == 1002.0
    assert terms["norm_outputs"] == 14.0
    assert terms["mlp"] == base.ffn_hidden_size + 3
    # the attention's terms are the same layer's either way
    plain = layer_activation_terms(base, 2, tp=2, kernels=LayerKernels(norms=True))
    assert terms["qkv"] == plain["qkv"] and terms["norm_inputs"] != plain["norm_inputs"]


def test_planner_reads_the_final_norms_declared_counts(odd_model):
    odd, base = odd_model
    assert final_norm_bytes(odd, 2, 1, False) == 12347.0
    assert final_norm_bytes(base, 2, 1, False) != 12347.0


def test_kernel_switches_follow_the_declared_kernels(odd_model):
    """Its layers are RMSNorm and SwiGLU modules, but the block declares neither kernel runs them."""
    odd, base = odd_model
    assert Precision().layer_kernels(odd) == LayerKernels(compiled=True, norms=False, rope=True, swiglu=False)
    assert Precision().layer_kernels(base) == LayerKernels(compiled=True, norms=True, rope=True, swiglu=True)
    flags = dataclasses.replace(KernelChoices(), swiglu="triton", rmsnorm="triton")
    assert len(kernel_problems(flags, 1, odd, "cuda", "bf16")) == 2
    assert kernel_problems(flags, 1, base, "cuda", "bf16") == []
