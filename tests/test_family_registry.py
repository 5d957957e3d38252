"""Model families are plug-ins (issue 33): a family is its folder under llamatron/models/families/ plus one entry in
the registry, and no module outside that folder names a family: no comparison with a ModelConfig's family, no
family name, Hugging Face model_type or transformers class as a value, no import of a family's own modules."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from llamatron.config.settings import config_from_values
from llamatron.errors import ConfigError
from llamatron.interop.hf import config_from_hf, config_to_hf
from llamatron.models.families import FAMILIES, get_preset, model_problems
from llamatron.models.inventory import num_params

PACKAGE = Path(__file__).resolve().parents[1] / "llamatron"
FAMILY_DIR = PACKAGE / "models" / "families"


def _family_names() -> set[str]:
    """Every name that stands for a family: its registry name, the model_types it reads, the transformers classes
    its exports name."""
    names = set(FAMILIES)
    for family in FAMILIES.values():
        names |= set(family.hf.model_types)
        for make in family.presets.values():
            names |= set(config_to_hf(make()).get("architectures", []))
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def naming_a_family(path: Path, names: set[str]) -> list[str]:
    """Where the module at `path` names a family (see the module docstring)."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in skip and isinstance(node.value, str):
            if node.value in names:
                found.append(f"{path}:{node.lineno} the string {node.value!r}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "family" for s in sides):
                found.append(f"{path}:{node.lineno} a comparison with .family")
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            if any(part in FAMILIES for part in module.split(".")) and "families" in module.split("."):
                found.append(f"{path}:{node.lineno} an import of {module}")
    return found


def test_no_module_outside_a_family_folder_names_a_family():
    names = _family_names()
    assert {"llama", "falcon", "qwen", "mixtral", "qwen3", "Qwen3ForCausalLM", "FalconForCausalLM"} <= names
    outside = [
        p for p in sorted(PACKAGE.rglob("*.py")) if FAMILY_DIR not in p.parents or p == FAMILY_DIR / "__init__.py"
    ]
    # The registry names each family once: the one line a family adds.
    found = [line for p in outside for line in naming_a_family(p, names) if p != FAMILY_DIR / "__init__.py"]
    assert not found, "\n".join(found)


def test_the_check_finds_what_it_looks_for(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Docstrings may say llama."""\n'
        "from llamatron.models.families.falcon import hf\n"
        "def f(cfg):\n"
        '    """falcon"""\n'
        '    return cfg.family == x or {"model_type": "mixtral"}\n'
    )
    found = naming_a_family(module, _family_names())
    assert len(found) == 3, found


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_builds_its_presets_and_round_trips_their_config(name):
    family = FAMILIES[name]
    assert family.presets, name
    for preset, make in family.presets.items():
        cfg = make()
        assert cfg.family == name, preset
        assert get_preset(preset) == cfg
        assert not model_problems(cfg), (preset, model_problems(cfg))
        assert set(cfg.changed_options()) <= family.options, preset
        assert num_params(cfg) > 0
        back = config_from_hf(config_to_hf(cfg))
        assert back == dataclasses.replace(cfg, init_std=back.init_std), preset


def test_families_read_disjoint_model_types_and_refuse_options_they_lack():
    types = [t for f in FAMILIES.values() for t in f.hf.model_types]
    assert len(types) == len(set(types))
    falcon = dataclasses.replace(get_preset("falcon-test"), num_experts=4)
    assert any("no such option" in p and "llama" in p for p in model_problems(falcon))
    # qk_norm is the qwen family's config's own field: a llama model cannot carry it (settings refuse it, naming qwen)
    with pytest.raises(ConfigError) as refused:
        config_from_values({"model": "llama-test", "model_overrides": {"qk_norm": True}}).model_config()
    assert "qk_norm" in str(refused.value) and "qwen" in str(refused.value)
    llama = get_preset("llama-test")
    assert "family 'gpt2' is not one of" in model_problems(dataclasses.replace(llama, family="gpt2"))[0]
