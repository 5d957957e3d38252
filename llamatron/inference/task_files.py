"""The Python a directory of lm-eval task YAML files (`--include-path`) would run, checked before lm-eval reads the
files with their functions resolved: each `!function MODULE.NAME` must name a module beside the task files, inside
that directory (docs/evaluation.md). lm-eval itself imports whatever the tag names: a file at an absolute path, one
that a symlink beside the YAML leads to, or a module found on sys.path when no file is there.

The files are read as lm-eval reads them (`lm_eval/tasks/_yaml_loader.py`: every `**/*.yaml`, `include:` followed,
a module looked up as MODULE with dots as slashes + .py beside the resolved YAML file), but nothing is imported.
Does not import lm_eval.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's index skips them
_BASE = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


class _Function(str):
    """The text of a `!function` tag."""


class _Loader(_BASE):  # type: ignore[valid-type,misc]  # the C loader where PyYAML has it, as lm-eval's
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


def foreign_functions(include_path: str, flag: str = "--include-path") -> list[str]:
    """Why the task files of `include_path` would import Python from outside it (empty when they would not); each
    problem names the YAML file, the tag and what it would import."""
    root = Path(include_path).resolve()
    files = sorted(p for p in Path(include_path).glob("**/*.yaml") if not _IGNORE_DIRS & set(p.parts))
    out = []
    for yaml_file in files:
        for where, spec in _functions(yaml_file, set()):
            module, _, _ = spec.rpartition(".")
            if not module:
                out.append(f"{where}: !function {spec} names no module; give MODULE.FUNCTION, MODULE.py beside it")
                continue
            found = (where.parent / f"{module.replace('.', '/')}.py").resolve()  # lm-eval's lookup
            if not found.exists():
                out.append(
                    f"{where}: !function {spec}: no {module.replace('.', '/')}.py beside it, so lm-eval would import "
                    f"{module} from the installed packages; put the module in {flag} {include_path}"
                )
            elif not found.is_relative_to(root):
                out.append(
                    f"{where}: !function {spec} would import {found}, outside {flag} {include_path}: a task's "
                    f"Python must be a module beside its YAML files in that directory"
                )
    return out


def _functions(path: Path, seen: set[Path]) -> Iterator[tuple[Path, str]]:
    """(the resolved YAML file, the tag's text) of every `!function` in `path` and the files it includes. A file
    that does not parse is left out, as lm-eval's index leaves it out."""
    path = path.expanduser().resolve()
    if path in seen or not path.is_file():
        return
    seen.add(path)
    try:
        cfg = yaml.load(path.read_bytes(), Loader=_Loader)  # noqa: S506  # a safe loader with one tag added
    except (yaml.YAMLError, OSError, ValueError):
        return
    yield from ((path, spec) for spec in _tags(cfg))
    includes = cfg.get("include") if isinstance(cfg, dict) else None
    for inc in includes if isinstance(includes, list) else [includes] if includes else []:
        if isinstance(inc, str):
            yield from _functions(Path(inc) if Path(inc).is_absolute() else path.parent / inc, seen)


def _tags(value: object) -> Iterator[str]:
    if isinstance(value, _Function):
        yield str(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tags(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tags(v)


__all__ = ["foreign_functions"]
