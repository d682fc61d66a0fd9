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
