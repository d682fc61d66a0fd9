"""The README's examples are true of the code, and the checker of shown results can fail.

Every ```python block of README.md runs and every result it shows is asserted, with the machinery of
tests/_doc_blocks.py (docs/*.md's blocks and the shell commands: tests/test_docs.py). ```py blocks, which download
real checkpoints from the hub, are only compiled (README.md's and docs/*.md's). The "Parameter tree" table of
docs/loading.md is rendered from `spec.drafter_spec` and compared."""

import os
import re

import pytest

from ._doc_blocks import DOCS, ROOT, blocks, check, instrument, printed, run_python_blocks


def test_readme_examples_run_and_show_true_results(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    checked = run_python_blocks("README.md", tmp_path)
    assert checked >= 5, f"README.md: its examples show fewer results than expected ({checked})"


def test_hub_examples_compile():
    found = [(path, b) for path in ["README.md", *DOCS] for b in blocks(path, "py")]
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
