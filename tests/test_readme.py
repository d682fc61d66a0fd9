"""Every ```python block of the README runs, each on its own (a fresh namespace), in order; ```py blocks, which
download real checkpoints from the hub, are only compiled. The documented examples work as written."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks(language: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run(monkeypatch, tmp_path):
    blocks = readme_blocks("python")
    assert len(blocks) >= 12
    monkeypatch.chdir(ROOT)  # examples name configs/ relative to the checkout
    for i, block in enumerate(blocks):
        code = block.replace("/tmp/", f"{tmp_path}/")
        try:
            exec(compile(code, f"README.md block {i}", "exec"), {"__name__": f"readme_block_{i}"})
        except Exception as e:  # noqa: BLE001  (report which block failed)
            pytest.fail(f"README block {i} failed: {type(e).__name__}: {e}\n{block}")


def test_readme_hub_examples_compile():
    blocks = readme_blocks("py")
    assert blocks and all("from_pretrained" in b or "load_drafter" in b for b in blocks)
    for i, block in enumerate(blocks):
        compile(block, f"README.md py block {i}", "exec")


# --- the "Parameter tree" table, derived from the spec ------------------------------------------------------

# A drafter with every optional part at once, its sizes chosen distinct so that each shape reads back as symbols.
EVERY_PART = {
    "hidden_size": 96, "num_hidden_layers": 2, "intermediate_size": 200, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 10, "vocab_size": 1000, "draft_vocab_size": 600, "rope_theta": 1e6,
    "attention_bias": True, "markov_rank": 12, "enable_confidence_head": True, "confidence_head_with_markov": True,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, 5], "conv_kernel_size": 3,
                      "conv_group_size": 16, "selector_rank": 14, "selector_top_k": 4},
}
SYMBOLS = {96: "H", 288: "Lf*H", 200: "I", 40: "nh*dh", 20: "nkv*dh", 10: "dh", 1000: "V", 600: "Vd", 14: "rs",
           12: "rm", 108: "H+rm", 3: "taps", 36: "2*taps*H/g", 2: "2", 1: "1"}


def tree_table() -> str:
    """The README table: each tensor of `spec.drafter_spec` (layers as templates), its shape in symbols, kind and
    optional part."""
    from dflash_jax.config import parse_config
    from dflash_jax.spec import drafter_spec

    rows = [(s.name, "[" + ", ".join(SYMBOLS[d] for d in s.shape) + "]", s.kind, s.optional or "")
            for s in drafter_spec(parse_config(EVERY_PART))]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "".join(f"{n:<{widths[0]}}  {shape:<{widths[1]}}  {kind:<{widths[2]}}  {part}".rstrip() + "\n"
                   for n, shape, kind, part in rows)


def test_readme_parameter_tree_is_the_spec():
    """The README's "Parameter tree" table is what `spec.drafter_spec` declares (regenerate it with `tree_table`)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("### Parameter tree", 1)[1]
    table = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    assert table == tree_table(), "README table differs from the spec; expected:\n" + tree_table()
