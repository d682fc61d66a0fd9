"""The documentation's examples are true of the code.

Every ```python block of README.md and docs/*.md runs, each on its own (a fresh namespace), in order, with files
under a temporary directory standing for `/tmp/`; every result a block shows in a comment is asserted:

    expr                      # -> 42            the value equals the literal (arrays compared as lists)
    expr                      # -> 0.1 +- 0.02   a number within the stated margin
    expr                      # -> Text ...      str(value) starts with the text before ` ...`
    print(a, b)               # -> a b           what the call prints
    expr  # -> (2, 7)  # why  a second `#` starts a note, which is not compared

A shown result on a line that is not an expression statement fails the test, as does a value that differs.
```py blocks, which download real checkpoints from the hub, are only compiled. The "Parameter tree" table of
docs/loading.md is rendered from `spec.drafter_spec` and compared."""

import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                             if f.endswith(".md"))]
SHOWN = re.compile(r"#\s*->\s*(.*?)\s*(?:\s#.*)?$")


def blocks(path: str, language: str) -> list[str]:
    with open(os.path.join(ROOT, path)) as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


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


@pytest.mark.parametrize("path", DOCS)
def test_examples_run_and_show_true_results(path, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # examples name configs/ relative to the checkout
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
    if path in ("README.md", "docs/loading.md", "docs/forward.md", "docs/generate.md"):
        assert checked >= 5, f"{path}: its examples show fewer results than expected ({checked})"


def test_hub_examples_compile():
    found = [(path, b) for path in DOCS for b in blocks(path, "py")]
    assert found and all("from_pretrained" in b or "load_drafter" in b or "load_target" in b for _, b in found)
    for path, block in found:
        compile(block, f"{path} py block", "exec")


def test_the_checker_fails_on_a_wrong_result():
    """The mechanism can fail: a wrong value, a wrong print and a result shown on an assignment."""
    wrong = ("1 + 1  # -> 3\n", "print('a', 2)  # -> a 3\n", "(0.5, 2)  # -> (0.5, 3)\n", "0.2  # -> 0.1 +- 0.05\n")
    for code in wrong:
        tree, n = instrument(code, "t")
        assert n == 1
        with pytest.raises(AssertionError):
            exec(compile(tree, "t", "exec"), {"__check__": check, "__printed__": printed})
    with pytest.raises(AssertionError, match="not an expression"):
        instrument("x = 1  # -> 1\n", "t")
    tree, _ = instrument("import numpy as np\nnp.arange(3)  # -> [0, 1, 2]  # a note\n'abcdef'  # -> abc ...\n", "t")
    exec(compile(tree, "t", "exec"), {"__check__": check, "__printed__": printed})


# --- the "Parameter tree" table of docs/loading.md, derived from the spec ------------------------------------------

# A drafter with every optional part at once, its sizes chosen distinct so that each shape reads back as symbols.
EVERY_PART = {
    "hidden_size": 96, "num_hidden_layers": 2, "intermediate_size": 200, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 10, "vocab_size": 1000, "draft_vocab_size": 600, "rope_theta": 1e6,
    "attention_bias": True, "attention_sink_bias": True, "markov_rank": 12, "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, 5], "conv_kernel_size": 3,
                      "conv_group_size": 16, "selector_rank": 14, "selector_top_k": 4},
}
SYMBOLS = {4: "nh", 96: "H", 288: "Lf*H", 200: "I", 40: "nh*dh", 20: "nkv*dh", 10: "dh", 1000: "V", 600: "Vd",
           14: "rs", 12: "rm", 108: "H+rm", 3: "taps", 36: "2*taps*H/g", 2: "2", 1: "1"}


def tree_table() -> str:
    """The table: each tensor of `spec.drafter_spec` (layers as templates), its shape in symbols, kind and optional
    part."""
    from dflash_jax.config import parse_config
    from dflash_jax.spec import drafter_spec

    # every part: a DSpark config (Markov and confidence heads) and a DFlash2 one (convolutions, selector); one
    # config with both is refused as half one family and half another
    dspark = {k: v for k, v in EVERY_PART.items() if k != "dflash_config"} | {"dflash_config": {
        k: v for k, v in EVERY_PART["dflash_config"].items() if not k.startswith(("conv_", "selector_"))}}
    dflash2 = {k: v for k, v in EVERY_PART.items() if k not in ("markov_rank", "enable_confidence_head",
                                                                  "confidence_head_with_markov")}
    specs = {s.name: s for config in (dspark, dflash2) for s in drafter_spec(parse_config(config))}
    rows = [(s.name, "[" + ", ".join(SYMBOLS[d] for d in s.shape) + "]", s.kind, s.optional or "")
            for s in specs.values()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "".join(f"{n:<{widths[0]}}  {shape:<{widths[1]}}  {kind:<{widths[2]}}  {part}".rstrip() + "\n"
                   for n, shape, kind, part in rows)


def test_parameter_tree_is_the_spec():
    """docs/loading.md's "Parameter tree" table is what `spec.drafter_spec` declares (regenerate it with
    `tree_table`)."""
    with open(os.path.join(ROOT, "docs", "loading.md")) as f:
        section = f.read().split("## Parameter tree", 1)[1]
    table = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    assert table == tree_table(), "docs/loading.md table differs from the spec; expected:\n" + tree_table()
