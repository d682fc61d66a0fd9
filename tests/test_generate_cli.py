"""`dflash-jax generate` and the progress callback behind its progress bar."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import load_drafter
from dflash_jax._qwen3_testing import write_qwen3_checkpoint
from dflash_jax.cli import main
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.target import Qwen3Target
from dflash_jax.testing import write_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_qwen3_checkpoint(root / "target", "tiny-qwen3", seed=2)
    write_checkpoint(root / "drafter", "tiny-dspark", seed=2)
    return str(root / "target"), str(root / "drafter")


def test_generate_verb_prints_the_greedy_continuation(checkpoints, capsys):
    target_dir, drafter_dir = checkpoints
    code = main(["generate", target_dir, drafter_dir, "--prompt-ids", "5, 17,99", "--max-new-tokens", "12",
                 "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert code == 0
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    expected = greedy_generate(target, [5, 17, 99], 12, stop_token_ids=target.config.eos_token_ids).tokens
    assert out.strip() == ",".join(map(str, expected))
    assert "mean acceptance length" in err and "tokens/s" in err


def test_progress_callback_sees_every_step(checkpoints):
    target_dir, drafter_dir = checkpoints
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    drafter = load_drafter(drafter_dir, dtype=jnp.float32)
    seen: list[np.ndarray] = []
    result = speculative_generate(target, drafter, [[5, 17, 99], [4]], max_new_tokens=12, progress=seen.append)
    assert len(seen) == max(len(steps) for steps in result.acceptance_lengths)
    counts = np.stack(seen)  # [steps, batch]: tokens made so far
    assert (np.diff(counts, axis=0) >= 0).all() and counts[-1].tolist() == [len(t) for t in result.tokens]


def test_generate_verb_reports_bad_checkpoints(checkpoints, tmp_path, capsys):
    _, drafter_dir = checkpoints
    assert main(["generate", str(tmp_path), drafter_dir, "--prompt-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err
