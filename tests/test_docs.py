"""docs/*.md as written: every ```python block runs and shows true results, every shell command the pages (and the
README) list runs, or says why it cannot here.

The blocks of a page run in this process, one page a test, with the machinery of tests/_doc_blocks.py (the
README's are tests/test_readme.py's). The commands: `dflash-jax ...` runs `dflash_jax.cli.main` in this process
(no second JAX start-up), with the placeholders PATH, SRC and DRAFTER a tiny drafter checkpoint, TARGET a tiny
target, DST a new directory and VERB `inspect`, and must exit 0; `python -c CODE` runs CODE here. A command this
machine cannot run (a GPU, the network, a cluster, the whole suite) is a skip whose reason is in its id, and a
command that no rule below covers fails: a new command in the docs comes with a way to run it or a reason."""

from __future__ import annotations

import os
import re

import pytest

from ._doc_blocks import DOCS, ROOT, run_python_blocks, shell_commands

PAGES = ["README.md", *DOCS]
SHELL_WORDS = re.compile(r"&&|\|")

# (a pattern the command's text matches, why it is not run here); the first that matches decides
NOT_RUN = [
    (r"pip install", "installs packages from the network"),
    (r"^(\.venv/bin/|/tmp/floors/bin/)?python3? -m pytest$", "the whole suite: CI runs it (.ci/run)"),
    (r"-m pytest .*-m gpu", "needs a CUDA GPU"),
    (r"-m pytest -n 0 -q tests/", "one module of the suite: the suite runs it"),
    (r"HYPOTHESIS_PROFILE=long", "the fuzz tests' long profile (half an hour): the suite runs their default one"),
    (r"ruff check", "tests/test_lint.py runs it"),
    (r"-m mypy", "CI runs it after the suite (.ci/run); minutes on 2 cores"),
    (r"Qwen/Qwen3-8B", "downloads real checkpoints from the hub"),
    (r"--distributed|--coordinator HOST", "needs a cluster (tests/test_multihost.py runs it over loopback)"),
    (r"^dflash-jax generate --coordinator$|^dflash-jax generate$|^dflash-jax load --weights packed$|"
     r"^dflash-jax generate \.\.\.", "names a verb or a flag (the whole command is in cli.md)"),
    (r"\[--", "a synopsis (brackets: optional flags), not a command"),
    (r"^python -m dflash_jax$", "names the program (`dflash-jax`)"),
    (r"python example\.py", "example.py stands for the blocks above it, run here with the suite's 8 devices"),
    (r"examples/speculative_decoding\.py", "tests/test_examples.py runs it"),
    (r"benchmarks/adaptive_model\.py", "about 50 s on 2 cores: its --small form runs in tests/test_benchmarks.py"),
    (r"benchmarks/load\.py", "writes a 948 MB checkpoint: its --small form runs in tests/test_benchmarks.py"),
    (r"benchmarks/plot\.py", "draws the JSON of GPU runs: tests/test_benchmarks.py runs it on the --small runs' JSON"),
    (r"benchmarks/", "needs a CUDA GPU (H100 / H200): its --small form runs in tests/test_benchmarks.py"),
]
PROGRAMS = re.compile(r"^(\.venv/bin/)?dflash-jax |^python3? -c ")


def _reason(command: tuple[str, ...]) -> str | None:
    text = " ".join(command)
    return next((why for pattern, why in NOT_RUN if re.search(pattern, text)), None)


def _commands():
    for page in PAGES:
        for command in shell_commands(page):
            text = " ".join(command)
            reason = _reason(command)
            marks = [pytest.mark.skip(reason=f"{page}: {reason}")] if reason else []
            yield pytest.param(page, command, marks=marks, id=f"{page}: {text[:70]}" + (f" [{reason}]" * bool(reason)))


@pytest.mark.parametrize("path", DOCS)
def test_python_blocks_run_and_show_true_results(path, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    checked = run_python_blocks(path, tmp_path)
    if path in ("docs/loading.md", "docs/forward.md", "docs/generate.md"):
        assert checked >= 5, f"{path}: its examples show fewer results than expected ({checked})"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The placeholders' stand-ins: a tiny drafter, a tiny target, a directory to write."""
    from dflash_jax.testing import write_checkpoint, write_qwen3_checkpoint

    root = tmp_path_factory.mktemp("docs_commands")
    write_checkpoint(root / "drafter", "tiny-dflash")
    write_qwen3_checkpoint(root / "target", "tiny-qwen3")
    drafter = str(root / "drafter")
    return {"PATH": drafter, "SRC": drafter, "DRAFTER": drafter, "TARGET": str(root / "target"), "VERB": "inspect"}


@pytest.mark.parametrize("page, command", list(_commands()))
def test_shell_command_runs(page, command, checkpoints, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(ROOT)
    text = " ".join(command)
    assert PROGRAMS.match(text) and not SHELL_WORDS.search(text), f"{page}: no rule runs or skips {text!r}"
    program, args = os.path.basename(command[0]), list(command[1:])
    if program == "dflash-jax":
        from dflash_jax.cli import main

        try:
            status = main([{**checkpoints, "DST": str(tmp_path / "out")}.get(a, a) for a in args])
        except SystemExit as e:  # --version, --help: argparse's exits
            status = e.code
        assert status == 0, f"{page}: {text} exited {status}\n{capsys.readouterr()}"
    else:  # python -c CODE; the prefill-memory command's 16k-token prompt (20 s of prefill here) shortened
        code = args[1].replace("16384", "256")
        exec(compile(code, f"{page}: {text[:40]}", "exec"), {"__name__": "__main__"})


def test_every_page_lists_its_commands():
    """The extraction finds what the pages show: a bash block's lines, an indented command, an inline one."""
    found = {page: [" ".join(c) for c in shell_commands(page)] for page in PAGES}
    assert "dflash-jax inspect --json PATH" in found["docs/cli.md"]
    assert ".venv/bin/python -m pytest" in found["docs/testing.md"]
    assert any(c.startswith("python -c import jax") for c in found["README.md"])
    assert _reason(("python3", "benchmarks/spec_decode.py")) and not _reason(("dflash-jax", "demo"))
