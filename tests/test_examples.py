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
    successor map nearly always (its 16-row blocks: well above 4); the adaptive run says its step costs are
    predicted (too few tokens to measure them in) and turns to plain steps."""
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
    # the adaptive run chooses by the predicted costs from its first step (16 tokens a prompt are too few to measure
    # them in), and the random drafter's rejected drafts turn it to plain steps
    line = r"    (\d+) of \d+ tokens from plain target steps; step costs predicted"
    plain = [re.fullmatch(line, printed) for printed in lines]
    assert any(m and int(m.group(1)) > 0 for m in plain), lines
