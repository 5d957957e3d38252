"""The package keeps the shape docs/design.md asks for: no import cycle, no function-local imports of its own
modules beyond a handful, no file over 600 lines, no function over 80 (scripts/code_shape.py checks them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / "scripts" / "code_shape.py")
code_shape = importlib.util.module_from_spec(_spec)
sys.modules["code_shape"] = code_shape
_spec.loader.exec_module(code_shape)


def test_llamatron_has_no_import_cycle_and_stays_small(capsys):
    status = code_shape.main([str(ROOT / "llamatron")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.splitlines()[-1].startswith("cycles 0 ")


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_checker_finds_cycles_local_imports_and_long_functions(tmp_path, capsys):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from . import a\n",
            "a.py": "from .b import g\n",
            "b.py": "from . import a\n\ndef g():\n    from .sub import c\n    return c\n",
            "sub/__init__.py": "",
            "sub/c.py": f"def long():\n{body}\n",
            # a cycle made only for type checking is a cycle too
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .typed2 import T\n",
            "typed2.py": "from .typed import x\nT = int\n",
        },
    )
    assert code_shape.main([str(pkg), "--max-local", "0"]) == 1
    out = capsys.readouterr().out
    assert "cycle: pkg.a pkg.b" in out
    assert "cycle: pkg.typed pkg.typed2" in out
    assert f"function-local import: {pkg / 'b.py'}:4" in out
    assert "long: 82 lines" in out
    assert out.splitlines()[-1] == "cycles 2 local 1 long-files 0 long-functions 1"
    # the local import alone is within the default allowance; the package's __init__ importing a is no cycle
    (pkg / "a.py").write_text("def g():\n    return 1\n")
    (pkg / "sub" / "c.py").write_text("def short():\n    return 1\n")
    (pkg / "typed2.py").write_text("T = int\n")
    assert code_shape.main([str(pkg)]) == 0


def test_the_checkpoint_format_imports_none_of_the_conversions():
    """checkpoint/ is llamatron's own format; interop/ (Hugging Face, Meta, Megatron-LM) sits above it and reads and
    writes the format through it, never the other way (docs/design.md, Checkpoints)."""
    edges, _ = code_shape.import_edges(code_shape.module_names(ROOT / "llamatron"))
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if module.startswith("llamatron.checkpoint")
        for target in targets
        if target.startswith("llamatron.interop")
    )
    assert upward == []
