"""Every ```python block of the README runs, in order, in one namespace: the documented examples work."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run(monkeypatch, tmp_path):
    blocks = readme_blocks()
    assert len(blocks) >= 8
    monkeypatch.chdir(ROOT)  # examples name configs/ relative to the checkout
    namespace: dict = {}
    for i, block in enumerate(blocks):
        code = block.replace("/tmp/", f"{tmp_path}/")
        try:
            exec(compile(code, f"README.md block {i}", "exec"), namespace)
        except Exception as e:  # noqa: BLE001  (report which block failed)
            pytest.fail(f"README block {i} failed: {type(e).__name__}: {e}\n{block}")
