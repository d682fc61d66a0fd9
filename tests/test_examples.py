"""The examples run (on their tiny checkpoints) and print what their docstrings promise."""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_speculative_decoding_example(monkeypatch, capsys):
    """Shorter runs (16 new tokens, not 96): every speculative run prints the greedy tokens; the random DFlash
    drafter is accepted about never (mean acceptance length near 1), the DSpark drafter walking the target's
    successor map nearly always (its 16-row blocks: well above 4); the adaptive run says its step costs are still
    being measured rather than offering its tokens/s as the policy's speed."""
    example = _example("speculative_decoding")
    monkeypatch.setattr(example, "MAX_NEW", 16)
    example.main()
    lines = capsys.readouterr().out.splitlines()
    spec = [line for line in lines if "mean acceptance length" in line]
    assert len(spec) == 3 and all("(same tokens as greedy)" in line for line in spec), lines
    acceptance = {line.split("  ")[0]: float(re.search(r"mean acceptance length ([\d.]+)", line).group(1))
                  for line in spec}
    assert acceptance["random target, random DFlash drafter"] < 1.5
    assert acceptance["successor target, DSpark drafter walking it"] > 4
    # the adaptive run's speed is not offered as the policy's: its runs (up to 16 tokens a prompt, fewer where the
    # random target emits its end-of-sequence id) end while it measures its costs
    assert any(re.fullmatch(r"    0 of \d+ tokens from plain target steps; step costs still being measured \(.*\)",
                            line) for line in lines), lines
