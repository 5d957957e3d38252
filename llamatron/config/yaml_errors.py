"""PyYAML's syntax errors as one line: where (file, line, column), what, and what to do about it.

PyYAML's own message spans several lines (the context, each mark with the line quoted and a caret under it):
a configuration error is one line naming the problem and the fix.
"""

from __future__ import annotations

import yaml

# (words in PyYAML's problem or context, what usually fixes it), the first that matches
_FIXES = [
    ("'\\t'", "indent with spaces: YAML does not allow tabs"),
    ("mapping values are not allowed", "indent a setting as the line above, or quote a value holding ': '"),
    ("flow sequence", "close the list's [ with ], its items separated by commas"),
    ("flow mapping", "close the mapping's { with }, its items separated by commas"),
    ("flow node", "close the { or [ opened before"),
    ("quoted scalar", "close the quote"),
    ("undefined alias", "define the &anchor before using the *alias, or quote a value starting with *"),
    ("constructor for the tag", "remove the !tag: a config is plain YAML (numbers, text, lists and mappings)"),
    ("block mapping", "give every setting as 'name: value' at the indentation of the others"),
    ("block collection", "give the list's items as '- item' at one indentation"),
    ("could not find expected ':'", "give every setting as 'name: value'"),
]


def yaml_error_line(where: str, e: yaml.YAMLError) -> str:
    """`where` (e.g. 'config file run.yaml') is not valid YAML, at line L, column C (1-based): the problem; the fix."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return f"{where} is not valid YAML ({' '.join(str(e).split())}); correct its syntax"
    mark = e.problem_mark or e.context_mark
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = " ".join(str(e.problem or e.context or "a syntax error").split())
    if e.context and e.context_mark and e.problem_mark:  # where the list, mapping or quote began
        problem += f" ({e.context}, line {e.context_mark.line + 1})"
    text = f"{e.problem or ''} {e.context or ''}"
    fix = next((f for words, f in _FIXES if words in text), "correct the YAML syntax there")
    return f"{where} is not valid YAML{at}: {problem}; {fix}"
