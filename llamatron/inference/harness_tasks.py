"""lm-evaluation-harness tasks: their names resolved (before any model loads), run on a `LlamatronLM`, and the
results as lm-eval's own dict, its table, and flat metric names for the training records.

Task files and datasets may be local: `--include-path DIR` adds DIR's task YAML files to lm-eval's own, and a
task whose `dataset_path: json` names `dataset_kwargs: {data_files: ...}` reads local JSON lines through
`datasets`, with nothing downloaded. Importing this module imports lm_eval (the `eval` extra).
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from datasets.exceptions import DatasetNotFoundError
from lm_eval import evaluator
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from ..errors import ConfigError, DataError
from .harness import LlamatronLM
from .task_files import foreign_functions

__all__ = ["LlamatronLM", "run_tasks", "results_table", "split_names", "task_manager", "task_metrics", "task_problems"]


def split_names(names: Sequence[str] | str | None) -> list[str]:
    """'a,b c' or ['a', 'b,c'] -> ['a', 'b', 'c'] (lm-eval's --tasks is comma-separated)."""
    if names is None:
        return []
    items = [names] if isinstance(names, str) else list(names)
    return [n for item in items for n in item.replace(",", " ").split()]


def task_problems(names: Sequence[str], include_path: str | None, flag: str = "--tasks") -> list[str]:
    """What is wrong with the task list: empty, an include path that is no directory, names (or glob patterns)
    that lm-eval does not know."""
    if not names:
        return [f"{flag} is empty: name one or more lm-eval tasks (comma-separated), e.g. {flag} hellaswag,arc_easy"]
    include_flag = "--eval-include-path" if flag == "--eval-tasks" else "--include-path"
    if include_path is not None and not Path(include_path).is_dir():
        return [f"{include_flag} {include_path}: not a directory of task YAML files"]
    if include_path is not None and (foreign := foreign_functions(include_path, include_flag)):
        return foreign[:1]  # before lm-eval reads the files with their functions resolved
    try:
        manager = task_manager(names, include_path)
    except ConfigError as e:
        return [str(e).replace("--tasks", flag)]
    return _dataless(manager, names)


def _dataless(manager: TaskManager, names: Sequence[str]) -> list[str]:
    """A YAML task that `names` loads (through groups, their members' settings and tags) without a data set: lm-eval
    would stop on it with a TypeError once the model is loaded."""
    index = manager.task_index
    todo: list[tuple[Any, dict]] = [(n, {}) for n in manager.match_tasks(list(names))]
    seen = set()
    while todo:
        item, inherited = todo.pop()  # a name, or a group's member as a mapping; the settings groups gave it
        if isinstance(item, dict):
            settings = {**inherited, **{k: v for k, v in item.items() if k not in ("task", "group")}}
            name = item.get("group", item.get("task"))
            if isinstance(name, str) and name in index:
                todo.append((name, settings))
            elif "group" in item:
                todo += [(m, settings) for m in _members(item)]
            elif not _has_data({**item, **inherited}):
                return [_no_data(item.get("task"), "written inline in a group")]
        elif item in index and item not in seen:
            seen.add(item)
            entry = index[item]
            cfg = entry.cfg or {}
            if entry.kind.name == "TAG":
                todo += [(t, inherited) for t in sorted(entry.tags)]
            elif entry.kind.name == "GROUP":
                settings = {**inherited, **{k: v for k, v in cfg.items() if k not in ("task", "group")}}
                todo += [(m, settings) for m in _members(cfg)]
            elif entry.kind.name == "TASK" and not _has_data({**cfg, **inherited}):
                return [_no_data(item, str(entry.yaml_path))]
    return []


def _members(group: dict) -> list:
    task = group.get("task")
    return task if isinstance(task, list) else [task] if task else []


def _has_data(cfg: dict) -> bool:
    """A data set named, or possibly by a file it includes (a group's inline member: not read here)."""
    return isinstance(cfg.get("dataset_path"), str) or "custom_dataset" in cfg or "include" in cfg


def _no_data(task: object, where: str) -> str:
    return (
        f"task {task} ({where}) has no dataset_path: name its data set (a Hugging Face dataset, or dataset_path: "
        "json with dataset_kwargs: {data_files: ...} for local files; docs/evaluation.md)"
    )


def task_manager(names: Sequence[str], include_path: str | None) -> TaskManager:
    """lm-eval's task index holding every name: the --include-path tasks alone where they hold them all (indexing
    lm-eval's ~15,000 built-in tasks takes seconds; the include path takes precedence over them anyway), else
    lm-eval's own with the include path's. ConfigError naming the unknown ones. Each index is built once per
    process: validation and the run share them."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # lm-eval's INFO lines are its own business
    local = _indexed(include_path, False) if include_path is not None else None
    if local is not None and not _unknown(names, local):
        return local
    builtin = _indexed(None, True)
    unknown = [n for n in _unknown(names, builtin) if local is None or n in _unknown(names, local)]
    if unknown:
        known = [*(local.all_tasks if local is not None else []), *builtin.all_tasks]  # a misspelt local one too
        hints = [f"{n} (did you mean {', '.join(c)}?)" if (c := _close(n, known)) else n for n in unknown]
        where = (
            f"lm-eval's tasks or {include_path}" if include_path else "lm-eval's tasks (add yours with --include-path)"
        )
        raise ConfigError(f"--tasks: unknown task{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: not in {where}")
    return builtin if include_path is None else _indexed(include_path, True)


@functools.lru_cache(maxsize=8)
def _indexed(include_path: str | None, builtin: bool) -> TaskManager:
    return TaskManager(include_path=include_path, include_defaults=builtin)


def _unknown(names: Sequence[str], manager: TaskManager) -> list[str]:
    return [n for n in names if not lm_utils.pattern_match([n], manager.all_tasks)]


def _close(name: str, known: Sequence[str]) -> list[str]:
    return difflib.get_close_matches(name, list(dict.fromkeys(known)), n=3, cutoff=0.75)


def run_tasks(
    lm: LM,
    manager: TaskManager,
    names: Sequence[str],
    limit: float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """lm-eval's results dict (results, groups, configs, versions, n-shot, ...) of `names` on `lm`; on every rank
    where `lm` is data-parallel. A dataset the Hub does not give is a DataError (one line)."""
    with _quiet_lm_eval(), _hub_failure_as_one_line(names):
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=list(names),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if lm.world_size > 1:  # lm-eval gathers the results on rank 0: every rank gets them
        box = [results]
        dist.broadcast_object_list(box, src=0)
        results = box[0]
    assert results is not None
    return results


@contextmanager
def _hub_failure_as_one_line(names: Sequence[str]) -> Iterator[None]:
    """A task's dataset that cannot be fetched (no network, a gated or missing dataset) stops the run with one
    line: what failed and what works instead (was huggingface_hub's retry lines, then datasets' traceback)."""
    try:
        yield
    except (ConnectionError, DatasetNotFoundError) as e:
        raise DataError(
            f"--tasks {','.join(names)}: {e}; lm-eval's tasks fetch their datasets from the Hugging Face Hub: run "
            "where it can be reached (once fills the cache; then HF_DATASETS_OFFLINE=1 reads it), or name local "
            "files in a task of --include-path"
        ) from None


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """Without lm-eval's lines that concern no user of llamatron, while a run lasts: its record of the current
    directory's git commit runs `git describe` with git's stderr on the console (outside a repository: 'fatal:
    not a git repository'), and huggingface_hub says each retry of a request that fails (the failure is one line)."""
    retries = logging.getLogger("huggingface_hub.utils._http")
    level = retries.level
    retries.setLevel(logging.ERROR)
    recorded = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = _git_commit_quietly
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = recorded
        retries.setLevel(level)


def _git_commit_quietly() -> str | None:
    """lm-eval's git_hash (the current directory's commit, where there is one), git's complaints kept quiet."""
    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return out.stdout.strip() or None


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of the tasks (and of the groups, where there are any)."""
    table = lm_utils.make_table(results)
    return table + ("\n" + lm_utils.make_table(results, "groups") if results.get("groups") else "")


_NOT_METRICS = ("alias", "name", "sample_len", "sample_count")  # what lm-eval's table leaves out too


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """{"TASK/METRIC": value} for the metric records: each task's (and group's) numbers, the filter named where
    it is not lm-eval's default ("none"); standard errors and sample counts left out."""
    out = {}
    for section in ("results", "groups"):
        for task, values in results.get(section, {}).items():
            for key, value in values.items():
                metric, _, flt = key.partition(",")
                if metric in _NOT_METRICS or metric.endswith("_stderr") or not isinstance(value, int | float):
                    continue
                name = f"{task}/{metric}" + (f"/{flt}" if flt and flt != "none" else "")
                out[name] = float(value) if math.isfinite(value) else math.nan
    return out
