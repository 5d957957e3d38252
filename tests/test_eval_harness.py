"""`llamatron eval` and its lm-evaluation-harness adapter (issue 37).

The adapter's numbers are checked against lm-eval's own Hugging Face adapter (`HFLM`) on the same model exported
with export-hf, fp32: the same requests give the same log-likelihoods (batched, right-padded, contexts longer than
the model's context cut from the left), the same rolling log-likelihoods (texts of several windows) and the same
results on local tasks (multiple choice, rolling perplexity, greedy generation) read from a task YAML and a
JSON-lines dataset written here; perplexity on a .bin/.idx set against transformers' loss on the same windows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import subprocess

import numpy as np
import pytest
import torch
from hf_fixtures import train_with_tokenizer

pytest.importorskip("lm_eval")  # the `eval` extra; the `test` extra installs it

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from llamatron.cli import main  # noqa: E402
from llamatron.data.indexed import IndexedDatasetWriter  # noqa: E402
from llamatron.data.tokenizer import load_tokenizer, train_bpe_tokenizer  # noqa: E402
from llamatron.errors import DataError  # noqa: E402
from llamatron.inference.harness import LlamatronLM  # noqa: E402
from llamatron.inference.model_source import load_model  # noqa: E402

CONTEXT = 32  # the model's context: texts of several windows stay short
TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "Rome was not built in a day. All that glitters is not gold. Where there is smoke there is fire.\n"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("eval"))


def build_models(workdir):
    """(llamatron checkpoint, its export-hf directory, tokenizer directory): llama-test with a 32-token context."""
    tok = workdir / "tok"
    train_bpe_tokenizer([TEXT * 20], 300, str(tok))
    ckpt = train_with_tokenizer(workdir, tok, 320, overrides=f", max_seq_length: {CONTEXT}")
    hf_dir = workdir / "hf"
    assert run("export-hf", ckpt, hf_dir) == 0
    return ckpt, hf_dir, tok


def run(*args) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def adapters(models, batch_size: int = 3) -> tuple[LlamatronLM, HFLM]:
    ckpt, hf_dir, tok = models
    ours = LlamatronLM(load_model(str(ckpt)), load_tokenizer(str(tok)), batch_size=batch_size)
    theirs = HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=batch_size, device="cpu")
    return ours, theirs


PAIRS = [
    ("The quick brown", " fox"),
    ("", "A stitch in time"),  # empty context: the prefix token (here EOS: no BOS) stands for it
    ("Rome was not built", " in a day. All that glitters"),
    ("All that glitters is not gold. " * 3, "Where there is smoke"),  # longer than the context: cut from the left
    ("Where there is smoke", " there is fire."),
    ("A", " stitch"),
    ("The lazy", " dog. A stitch in time saves nine."),
]
TEXTS = ["The quick brown fox.", TEXT, TEXT * 2, "A stitch in time saves nine."]


def test_loglikelihoods_equal_hflm_on_the_exported_model(models):
    ours, theirs = adapters(models)
    got = ours.loglikelihood(requests("loglikelihood", PAIRS))
    want = theirs.loglikelihood(requests("loglikelihood", PAIRS))
    assert [g for _, g in got] == [g for _, g in want]
    np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in want], rtol=0, atol=1e-4)
    assert len({len(ours.tok_encode(c + x)) for c, x in PAIRS}) > 3  # the batches mix lengths: padding matters
    assert len(ours.tok_encode(TEXT * 2)) > 3 * CONTEXT  # the rolling texts span several windows
    got_rolling = ours.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]))
    want_rolling = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]))
    np.testing.assert_allclose(got_rolling, want_rolling, rtol=0, atol=1e-4)
    with pytest.raises(DataError, match="longer than the model's context of 32"):  # HFLM asserts
        ours.loglikelihood(requests("loglikelihood", [("A", TEXT * 2)]))
    # the Hugging Face directory itself, converted as it loads, is the same model
    from_hf = LlamatronLM(load_model(str(models[1])), ours.tok, batch_size=3)
    np.testing.assert_allclose(
        from_hf.loglikelihood_rolling(requests("loglikelihood_rolling", [(TEXT,)])), want_rolling[1:2], atol=1e-4
    )


@contextlib.contextmanager
def logged(name: str):
    """The messages logger `name` lets through (its level and filters passed) while the block runs: what reaches
    the console outside pytest, whose own log capture takes them here."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(name).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(name).removeHandler(handler)


def write_tasks(directory) -> list[str]:
    """Three local tasks over JSON-lines files in `directory`: multiple choice, rolling perplexity, generation."""
    directory.mkdir(exist_ok=True)
    questions = [
        {"question": "The quick brown", "choices": [" fox", " dog", " day"], "answer": 0},
        {"question": "A stitch in time", "choices": [" saves nine.", " is gold.", " jumps."], "answer": 0},
        {"question": "Rome was not built", "choices": [" in a day.", " over the dog.", " fire."], "answer": 0},
        {"question": "All that glitters", "choices": [" is not gold.", " saves nine."], "answer": 0},
        {"question": "Where there is smoke", "choices": [" there is fire.", " in a day."], "answer": 1},
    ]
    pages = [{"page": TEXT}, {"page": TEXT * 2}, {"page": "Rome was not built in a day."}]
    prompts = [{"question": q["question"], "answer": q["choices"][q["answer"]]} for q in questions]
    for name, rows in (("mc", questions), ("pages", pages), ("prompts", prompts)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: train\n"

    def data(name: str) -> str:
        return f"dataset_kwargs:\n  data_files:\n    train: {directory / name}.jsonl\n"

    (directory / "local_mc.yaml").write_text(
        "task: local_mc\n" + common + data("mc") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (directory / "local_pages.yaml").write_text(
        "task: local_pages\n" + common + data("pages") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{page}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (directory / "local_gen.yaml").write_text(
        "task: local_gen\n" + common + data("prompts") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return ["local_mc", "local_pages", "local_gen"]


def test_local_tasks_give_hflms_results(models, tmp_path, monkeypatch, capfd):
    """`llamatron eval --include-path` on local task files and data, JSON and table; lm-eval's simple_evaluate with
    HFLM on the exported model gives the same numbers. Nothing is downloaded. Run outside a git repository, lm-eval
    says nothing of it (git's 'fatal: not a git repository'), nor of the metrics its tasks list without an
    aggregation."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert subprocess.run(["git", "rev-parse"], capture_output=True).returncode != 0  # not inside a repository
    ckpt, hf_dir, _ = models
    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "results.json"
    args = ["--tasks", ",".join(tasks), "--include-path", tmp_path / "tasks", "--batch-size", "2"]
    with logged("lm_eval.api.task") as records:
        assert run("eval", "--load", ckpt, *args, "--output", out, "--device", "cpu") == 0
    table, err = capfd.readouterr()
    assert "local_mc" in table and "acc" in table and "word_perplexity" in table and "exact_match" in table
    assert "not a git repository" not in err, err
    assert not [m for m in records if "is defined, but" in m], records
    ours = json.loads(out.read_text())["results"]
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    hf = HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=2, device="cpu")
    theirs = evaluator.simple_evaluate(model=hf, tasks=tasks, task_manager=manager, log_samples=False)["results"]
    for task in tasks:
        for key, value in theirs[task].items():
            if isinstance(value, float) and "stderr" not in key:
                assert ours[task][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, key)


def test_greedy_continuations_equal_hflms(models):
    """generate_until: the same text as HFLM (transformers' greedy generate), cut at the first stop string."""
    ours, theirs = adapters(models, batch_size=2)
    prompts = ["The quick brown", "Rome", "A stitch in time saves"]
    free = ours.generate_until(
        requests("generate_until", [(p, {"until": ["@@"], "max_gen_toks": 10}) for p in prompts])
    )
    stop = free[1][len(free[1]) // 2]  # a character from the middle of one continuation
    args = [(p, {"until": [stop], "max_gen_toks": 10}) for p in prompts] + [(prompts[0], {"max_gen_toks": 4})]
    got = ours.generate_until(requests("generate_until", args))
    assert got == theirs.generate_until(requests("generate_until", args))
    assert got[1] == free[1].split(stop)[0] and len(got[1]) < len(free[1])
    assert all(free) and len(got[3]) < len(free[0])  # fewer tokens: a shorter text


def test_perplexity_on_an_indexed_set_equals_transformers_loss(models, tmp_path):
    """--data-path: the documents joined and cut into windows of --seq-length + 1 tokens sharing one token; the
    loss over every predicted token equals transformers' on the same windows."""
    from transformers import AutoModelForCausalLM

    ckpt, hf_dir, tok_dir = models
    tok = load_tokenizer(str(tok_dir))
    docs = [tok.encode(t) for t in (TEXT, "Rome was not built in a day.", TEXT * 2, "A stitch.")]
    writer = IndexedDatasetWriter(str(tmp_path / "set"), dtype=np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    out = tmp_path / "ppl.json"
    seq = 24
    assert run("eval", "--load", ckpt, "--data-path", tmp_path / "set", "--seq-length", seq, "--output", out) == 0
    result = json.loads(out.read_text())["perplexity"]
    stream = torch.tensor([t for d in docs for t in d])
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, seq):  # windows of seq + 1 tokens, each sharing one with the next
        window = stream[start : start + seq + 1][None]
        with torch.no_grad():
            total += float(hf(window, labels=window).loss) * (window.shape[1] - 1)
        count += window.shape[1] - 1
    assert result["tokens"] == count == len(stream) - 1 and result["windows"] == math.ceil(count / seq)
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert run("eval", "--load", hf_dir, "--data-path", tmp_path / "set", "--seq-length", seq, "--output", out) == 0
    assert json.loads(out.read_text())["perplexity"]["loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "local_mc"], "configuration error: --load is missing: give the checkpoint"),
        (["--load", "CKPT", "--tasks", ""], "configuration error: --tasks is empty: name one or more lm-eval tasks"),
        (["--load", "CKPT", "--tasks", " , "], "configuration error: --tasks is empty"),
        (["--load", "CKPT"], "configuration error: nothing to evaluate: give --tasks NAMES"),
        (
            ["--load", "CKPT", "--tasks", "local_mc,no_such_task", "--include-path", "TASKS"],
            "configuration error: --tasks: unknown task no_such_task: not in lm-eval's tasks or ",
        ),
        (
            ["--load", "CKPT", "--tasks", "local_mcq", "--include-path", "TASKS"],
            "--tasks: unknown task local_mcq (did you mean local_mc?): not in lm-eval's tasks or ",
        ),
        (["--load", "CKPT", "--tasks", "local_mc", "--include-path", "nowhere"], "--include-path nowhere: not a dir"),
        (["--load", "nowhere", "--tasks", "local_mc"], "configuration error: --load nowhere: no such checkpoint"),
        (["--load", "CKPT", "--data-path", "nowhere"], "data error: "),
        (["--load", "CKPT", "--data-path", "nowhere", "--seq-length", "33"], "--seq-length 33: beyond the model's"),
        (["--load", "CKPT", "--data-path", "x", "--num-fewshot", "2"], "--num-fewshot applies to lm-eval tasks"),
        # found only after the whole evaluation, the results lost
        (["--load", "CKPT", "--data-path", "x", "--output", "TASKS"], "--output TASKS is a directory; give a file"),
        (["--load", "CKPT", "--data-path", "x", "--output", "/proc/x.json"], "--output /proc/x.json: cannot create"),
    ],
)
def test_bad_input_is_one_line_before_the_model_loads(models, tmp_path, monkeypatch, capsys, args, message):
    from llamatron.commands import eval as eval_command

    monkeypatch.setattr(eval_command, "load_model", lambda *a: pytest.fail("the model was loaded"))
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    (tmp_path / "set.idx").write_bytes(b"")
    paths = {"CKPT": str(models[0]), "TASKS": str(tasks), "x": str(tmp_path / "set")}
    if "--seq-length" in args:  # a data set that opens: the window is what is wrong
        writer = IndexedDatasetWriter(str(tmp_path / "ok"), dtype=np.uint16)
        writer.add_document([1, 2, 3])
        writer.finalize()
        paths["nowhere"] = str(tmp_path / "ok")
    assert run("eval", *[paths.get(a, a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("TASKS", str(tasks)) in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"tp": 2}, "--eval-tasks runs lm-eval on a whole model per rank, which --tp 2 splits"),
        ({"pp": 2}, "which --pp 2 splits"),
        ({"eval_tasks": []}, "--eval-include-path applies to lm-eval tasks: add --eval-tasks NAMES"),
        ({"tokenizer": None}, "--eval-tasks: lm-eval's tasks are text; give the model's --tokenizer"),
        ({"eval_tasks": ["no_such_task"]}, "--eval-tasks: unknown task no_such_task"),
    ],
)
def test_train_eval_tasks_refused_where_no_rank_holds_the_model(models, tmp_path, flags, message):
    """--eval-tasks under tp or pp (no rank holds the whole model) is refused in one line before anything is built,
    as are the task flags without tasks, tasks without a tokenizer and unknown task names (here, in the process
    that already indexed lm-eval's tasks for `eval`'s unknown name)."""
    from llamatron.config.settings import RunConfig, set_setting
    from llamatron.errors import ConfigError
    from llamatron.training.validate import validate

    cfg = RunConfig()
    cfg.train.model, cfg.data.mock_data, cfg.train.device = "llama-test4", True, "cpu"
    cfg.data.tokenizer, cfg.train.eval_tasks, cfg.train.eval_limit = str(models[2]), ["local_mc"], 2
    cfg.train.eval_include_path = str(tmp_path / "tasks")
    write_tasks(tmp_path / "tasks")
    for key, value in flags.items():
        set_setting(cfg, key, value)
    cfg.train.global_batch_size = cfg.train.micro_batch_size = 2
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2 if {"tp", "pp"} & set(flags) else 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bos_as_hflm_adds_it(models, tmp_path):
    """A tokenizer whose post-processor puts BOS first (as Llama 3's does): the adapter's texts start with it as
    HFLM's (transformers' add_special_tokens=True) do, and the log-likelihoods stay equal."""
    import shutil

    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.processors import TemplateProcessing

    ckpt, hf_dir, tok_dir = models
    bos_dir = tmp_path / "hf-bos"
    shutil.copytree(hf_dir, bos_dir)
    raw = RawTokenizer.from_file(str(bos_dir / "tokenizer.json"))
    raw.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    raw.save(str(bos_dir / "tokenizer.json"))
    config = json.loads((bos_dir / "tokenizer_config.json").read_text())
    (bos_dir / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    ours = LlamatronLM(load_model(str(ckpt)), load_tokenizer(str(bos_dir)), batch_size=3)
    theirs = HFLM(pretrained=str(bos_dir), dtype="float32", batch_size=3, device="cpu")
    assert ours.add_bos and ours.tok_encode("The fox")[0] == 0
    assert [ours.tok_encode(t) for t in TEXTS] == [theirs.tok_encode(t) for t in TEXTS]
    got = [lp for lp, _ in ours.loglikelihood(requests("loglikelihood", PAIRS))]
    np.testing.assert_allclose(got, [lp for lp, _ in theirs.loglikelihood(requests("loglikelihood", PAIRS))], atol=1e-4)
    rolling = [(t,) for t in TEXTS]
    np.testing.assert_allclose(
        ours.loglikelihood_rolling(requests("loglikelihood_rolling", rolling)),
        theirs.loglikelihood_rolling(requests("loglikelihood_rolling", rolling)),
        atol=1e-4,
    )


def test_a_dataset_the_hub_does_not_give_is_one_line(models, tmp_path, monkeypatch, capfd):
    """No Hub (here datasets' load_dataset as it fails without a network, after huggingface_hub's retry lines): one
    line saying what failed and what works, no retry lines, no traceback, exit 2."""
    import datasets

    def unreachable(path, *args, **kwargs):
        retries = logging.getLogger("huggingface_hub.utils._http")
        for attempt in range(1, 6):
            retries.warning(f"'[Errno -2] Name or service not known' thrown while requesting HEAD {path}")
            retries.warning(f"Retrying in {2**attempt}s [Retry {attempt}/5].")
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    with logged("huggingface_hub.utils._http") as records:
        assert run("eval", "--load", models[0], "--tasks", "local_mc", "--include-path", tasks, "--device", "cpu") == 2
    assert records == []
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Couldn't reach 'json' on the Hub" in err[0], err
    assert err[0].startswith("llamatron eval: data error: --tasks local_mc: ") and "HF_DATASETS_OFFLINE=1" in err[0]


FUNCTION = (
    "def docs(dataset):\n    import pathlib\n    pathlib.Path(__file__).with_name('RAN').touch()\n    return dataset\n"
)


def _task_with_function(tasks, spec: str, name: str = "local_fn", into=None) -> None:
    """local_mc of `tasks` as task `name` with a `!function` (written into `into`, default `tasks`)."""
    text = (tasks / "local_mc.yaml").read_text().replace("task: local_mc", f"task: {name}")
    ((into or tasks) / f"{name}.yaml").write_text(text + f"process_docs: !function {spec}\n")


@pytest.mark.parametrize("how", ["absolute", "symlinked module", "symlinked yaml", "included yaml", "installed"])
def test_python_from_outside_the_include_path_is_refused_unrun(models, tmp_path, monkeypatch, capsys, how):
    """A task's `!function` may import only a module beside the task files (docs/evaluation.md); lm-eval imports
    whatever it names. Refused in one line before the model loads, the module not run."""
    from llamatron.commands import eval as eval_command

    monkeypatch.setattr(eval_command, "load_model", lambda *a: pytest.fail("the model was loaded"))
    tasks, outside = tmp_path / "tasks", tmp_path / "outside"
    write_tasks(tasks)
    outside.mkdir()
    (outside / "evil.py").write_text(FUNCTION)
    if how == "absolute":
        _task_with_function(tasks, f"{outside / 'evil'}.docs")
    elif how == "symlinked module":
        (tasks / "utils.py").symlink_to(outside / "evil.py")
        _task_with_function(tasks, "utils.docs")
    elif how == "symlinked yaml":  # the YAML's own directory is where lm-eval looks
        _task_with_function(tasks, "evil.docs", into=outside)
        (tasks / "local_fn.yaml").symlink_to(outside / "local_fn.yaml")
    elif how == "included yaml":
        _task_with_function(tasks, "evil.docs", "base", into=outside)
        (tasks / "local_fn.yaml").write_text(f"include: {outside / 'base.yaml'}\ntask: local_fn\n")
    else:  # no module beside it: lm-eval imports the name from sys.path
        _task_with_function(tasks, "os.path.basename")
    assert run("eval", "--load", models[0], "--tasks", "local_fn", "--include-path", tasks) == 2
    err = capsys.readouterr().err.strip()
    said = "from the installed packages" if how == "installed" else f"would import {outside / 'evil.py'}, outside"
    assert said in err and len(err.splitlines()) == 1, err
    assert not (outside / "RAN").exists()


def test_python_beside_the_task_files_runs(models, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    (tasks / "helpers").mkdir()
    (tasks / "helpers" / "docs.py").write_text(FUNCTION)
    _task_with_function(tasks, "helpers.docs.docs")
    assert run("eval", "--load", models[0], "--tasks", "local_fn", "--include-path", tasks, "--limit", "1") == 0
    assert (tasks / "helpers" / "RAN").exists() and "local_fn" in capsys.readouterr().out


@pytest.mark.parametrize("grouped", [False, True])
def test_a_task_without_a_data_set_is_refused_before_the_model_loads(models, tmp_path, monkeypatch, capsys, grouped):
    """lm-eval stopped on it with a TypeError once the model had loaded; a group's member too."""
    from llamatron.commands import eval as eval_command

    monkeypatch.setattr(eval_command, "load_model", lambda *a: pytest.fail("the model was loaded"))
    tasks = tmp_path / "tasks"
    write_tasks(tasks)
    text = (tasks / "local_mc.yaml").read_text().replace("task: local_mc", "task: no_data")
    (tasks / "no_data.yaml").write_text(text.replace("dataset_path: json\n", ""))
    (tasks / "quiz.yaml").write_text("group: quiz\ntask:\n  - local_mc\n  - no_data\n")
    name = "quiz" if grouped else "no_data"
    assert run("eval", "--load", models[0], "--tasks", name, "--include-path", tasks) == 2
    err = capsys.readouterr().err.strip()
    assert f"task no_data ({tasks / 'no_data.yaml'}) has no dataset_path" in err and len(err.splitlines()) == 1, err
