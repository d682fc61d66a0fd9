"""The documentation's examples, run as written: the fenced blocks and shell commands of README.md and docs/*.md.

Every ```python block of a page runs, each on its own (a fresh namespace), in order, with files under a temporary
directory standing for `/tmp/`; every result a block shows in a comment is asserted:

    expr                      # -> 42            the value equals the literal (arrays compared as lists)
    expr                      # -> 0.1 +- 0.02   a number within the stated margin
    expr                      # -> Text ...      str(value) starts with the text before ` ...`
    print(a, b)               # -> a b           what the call prints
    expr  # -> (2, 7)  # why  a second `#` starts a note, which is not compared

A shown result on a line that is not an expression statement fails, as does a value that differs. ```py blocks,
which download real checkpoints from the hub, are only compiled.

Shell commands (`shell_commands`): the lines of ```bash blocks, indented command lines, and inline code spans that
start a program (`python`, `dflash-jax`, `.venv/bin/...`, with any `VAR=value` before it)."""

from __future__ import annotations

import ast
import io
import os
import re
import shlex
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
SHOWN = re.compile(r"#\s*->\s*(.*?)\s*(?:\s#.*)?$")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def blocks(path: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", read(path), flags=re.S)


def shown_results(code: str) -> dict[int, str]:
    """Line number -> the result its comment shows (`# -> ...`)."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT and (m := SHOWN.match(tok.string)):
            found[tok.start[0]] = m.group(1)
    return found


def normalise(value):
    """Arrays (NumPy, JAX) and NumPy scalars as Python lists and numbers; tuples and lists element-wise."""
    if isinstance(value, tuple | list):
        return type(value)(normalise(v) for v in value)
    return value.tolist() if hasattr(value, "tolist") else value


def matches(value, shown: str) -> bool:
    if shown.endswith(" ..."):
        return str(value).startswith(shown[:-4])
    if m := re.fullmatch(r"(\S+) \+- (\S+)", shown):
        return abs(float(value) - float(m.group(1))) <= float(m.group(2))
    try:
        expected = ast.literal_eval(shown)
    except (ValueError, SyntaxError):
        return shown in (str(value), repr(value))
    return normalise(value) == expected


def printed(*args) -> str:
    text = " ".join(map(str, args))
    print(text)
    return text


def check(value, shown: str, where: str):
    assert matches(value, shown), f"{where}: shows {shown!r}, got {value!r}"
    return value


def instrument(code: str, where: str) -> tuple[ast.Module, int]:
    """The block's module, each expression statement with a shown result wrapped in `__check__` (and a `print`
    call in `__printed__`, which returns the printed text); how many results it checks."""
    shown = shown_results(code)
    tree = ast.parse(code)
    checked = 0
    for stmt in tree.body:
        lines = [n for n in range(stmt.lineno, stmt.end_lineno + 1) if n in shown]
        if not lines:
            continue
        line = lines[-1]
        assert isinstance(stmt, ast.Expr), (
            f"{where} line {line}: a shown result on a statement that is not an expression")
        value = stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
            value.func.id = "__printed__"
        stmt.value = ast.Call(ast.Name("__check__", ast.Load()),
                              [value, ast.Constant(shown[line]), ast.Constant(f"{where} line {line}")], [])
        checked += 1
    # a shown result inside a compound statement (a loop, a try) is not checked: refuse it rather than skip it
    top = {n for stmt in tree.body for n in range(stmt.lineno, stmt.end_lineno + 1) if isinstance(stmt, ast.Expr)}
    assert set(shown) <= top, f"{where}: shown results on lines {sorted(set(shown) - top)} are not checked"
    return ast.fix_missing_locations(tree), checked


def run_python_blocks(path: str, tmp_path) -> int:
    """Run every ```python block of `path` (relative to the checkout, which must be the working directory), each in
    a fresh namespace, `/tmp/` standing for `tmp_path`; fail naming the block. Returns the results checked."""
    checked = 0
    for i, block in enumerate(blocks(path, "python")):
        where = f"{path} python block {i}"
        tree, n = instrument(block.replace("/tmp/", f"{tmp_path}/"), where)
        checked += n
        namespace = {"__name__": f"doc_block_{i}", "__check__": check, "__printed__": printed}
        try:
            exec(compile(tree, where, "exec"), namespace)
        except Exception as e:  # noqa: BLE001  (report which block failed)
            pytest.fail(f"{where} failed: {type(e).__name__}: {e}\n{block}")
    return checked


# a program a command starts: python, the CLI, a virtual environment's tools; `VAR=value` settings may come first
_PROGRAM = r"(?:[A-Z_]+=\S*\s+)*(?:python3?|dflash-jax|\.venv/bin/\S+|/tmp/\S+/bin/\S+)(?:\s|$)"


def shell_commands(path: str) -> list[tuple[str, ...]]:
    """Every shell command `path` lists, in order, each once, as its words (quotes removed, comments dropped): the
    lines of its ```bash blocks (an indented line, or one after a `\\`, goes on the one before), its indented lines
    that start a program, and its inline code spans that do (more than a program's name)."""
    text = read(path)
    found: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        found += re.sub(r"\\?\n(?=[ \t])", " ", block).splitlines()  # an indented line goes on the one before
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [m.group(1) for m in re.finditer(r"^ {4,}(\S(?:[^\n]*\\\n)*[^\n]*)$", prose, flags=re.M)
              if re.match(_PROGRAM, m.group(1))]
    found += [span for span in re.findall(r"`([^`]+)`", prose) if re.match(_PROGRAM, span) and " " in span.strip()]
    commands = (tuple(shlex.split(c.replace("\\\n", " "), comments=True)) for c in found)
    return list(dict.fromkeys(c for c in commands if c))
