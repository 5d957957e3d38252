"""What a training process imports beyond torch itself: every rank of every layout test is a fresh process, so
an import that building a model, a mask or an expert exchange pulls in is paid once per rank (torch._dynamo
1.5 s of CPU, sympy 0.35 s, against ~3 s for a whole 5-step single-process run of llama-test)."""

import subprocess
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_mask

from llamatron.models.attention import _keep, dense_mask, load_balanced_index

# One process: a model materialised from meta, the dense masks of context parallelism, a sliding window and
# documents, and an expert exchange built, as an eager CPU run does them.
BUILD = """
import sys, torch
from llamatron.models import build_model, get_preset, materialize
from llamatron.models.attention import attention_mask
from llamatron.parallel.expert import ExpertParallelDispatch
cfg = get_preset("llama-test")
materialize(build_model(cfg), cfg, 0, "cpu", torch.float32)
attention_mask(16, 5, torch.zeros(2, 32, dtype=torch.long), torch.device("cpu"), context=(2, 1))
ExpertParallelDispatch(None, 2, 2)
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_building_a_model_masks_and_the_expert_exchange_imports_neither_dynamo_nor_sympy():
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, cwd=repo, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[]", proc.stdout


def test_dense_masks_equal_flex_attentions_create_mask():
    """dense_mask broadcasts the rule where create_mask vmaps it: every rule the models use, at cp 3."""
    documents = torch.tensor([[0] * 11 + [1] * 30 + [2] * 7, [0] * 48])
    for docs in (None, documents):
        for window, chunk in ((None, None), (5, None), (20, None), (None, 8), (5, 8)):
            batch = 1 if docs is None else 2
            for index in [None, *(load_balanced_index(48, 3, rank) for rank in range(3))]:
                queries = 48 if index is None else 16
                rule = _keep(index, docs, window, chunk)
                want = create_mask(rule, batch, 1, queries, 48, device="cpu")
                got = dense_mask(rule, batch, queries, 48, torch.device("cpu"))
                assert got.dtype == want.dtype and torch.equal(got, want), (docs is None, window, chunk, index)


def test_compiling_the_layers_keeps_the_expert_exchange_eager():
    """The exchange reads split sizes on the host: apply_compile disables torch.compile around it (no longer done
    when the exchange is built, which imported torch._dynamo into eager runs)."""
    from llamatron.models import build_model, get_preset
    from llamatron.models.moe import MoE
    from llamatron.parallel.expert import ExpertParallelDispatch
    from llamatron.training.engine import apply_compile

    model = build_model(get_preset("mixtral-test"), device="meta")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.dispatch = ExpertParallelDispatch(None, 2, 2)
    assert moes and not any(getattr(m.dispatch._exchange, "_torchdynamo_disable", False) for m in moes)
    apply_compile(model)
    assert all(getattr(m.dispatch._exchange, "_torchdynamo_disable", False) for m in moes)
