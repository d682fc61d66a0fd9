"""`dflash-jax generate` and the progress callback behind its progress bar."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import AttentionOptions, GenerationResult, cli, load_drafter
from dflash_jax import generate as generate_module
from dflash_jax.cli import main
from dflash_jax.generate import greedy_generate, speculative_generate
from dflash_jax.target.dense import Qwen3Target
from dflash_jax.testing import write_checkpoint, write_qwen3_checkpoint

from ._hub import add_to_cache, directory_files  # first: HF_HUB_OFFLINE=1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_qwen3_checkpoint(root / "target", "tiny-qwen3", seed=2)
    write_checkpoint(root / "drafter", "tiny-dspark", seed=2)
    return str(root / "target"), str(root / "drafter")


def test_generate_verb_prints_the_greedy_continuation(checkpoints, capsys):
    """At the fixed draft length, the program `test_generate_takes_hub_ids` runs too (the CLI under the default
    adaptive policy: docs/cli.md's `dflash-jax generate` command in tests/test_docs.py, and across processes in
    tests/test_multihost.py; the flag reaching `speculative_generate`: `test_generate_passes_the_draft_length`)."""
    target_dir, drafter_dir = checkpoints
    code = main(["generate", target_dir, drafter_dir, "--prompt-ids", "5, 17,99", "--max-new-tokens", "12",
                 "--dtype", "float32", "--draft-length", "fixed"])
    out, err = capsys.readouterr()
    assert code == 0
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    expected = greedy_generate(target, [5, 17, 99], max_new_tokens=12,
                               stop_token_ids=target.config.eos_token_ids).tokens[0]
    assert out.strip() == ",".join(map(str, expected))
    assert "mean acceptance length" in err and "tokens/s" in err


def test_generate_verb_at_a_tiny_temperature_prints_the_greedy_continuation(checkpoints, capsys):
    """At `--temperature 1e-12` sampling is certain: the greedy tokens (logits / T once made the target's softmax
    NaN, every draft was rejected and the NaN residual drew id 0)."""
    target_dir, drafter_dir = checkpoints
    code = main(["generate", target_dir, drafter_dir, "--prompt-ids", "5,17,99", "--max-new-tokens", "12",
                 "--dtype", "float32", "--temperature", "1e-12", "--seed", "1"])
    out, _ = capsys.readouterr()
    assert code == 0
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    expected = greedy_generate(target, [5, 17, 99], max_new_tokens=12,
                               stop_token_ids=target.config.eos_token_ids).tokens[0]
    assert out.strip() == ",".join(map(str, expected))


def test_progress_callback_sees_every_step(checkpoints):
    """At the fixed draft length, in a decode program of one length's branch, not three (the adaptive policy's
    loop: tests/test_adaptive.py)."""
    target_dir, drafter_dir = checkpoints
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    drafter = load_drafter(drafter_dir, dtype=jnp.float32)
    seen: list[np.ndarray] = []
    result = speculative_generate(target, drafter, [[5, 17, 99], [4]], max_new_tokens=12, progress=seen.append,
                                  draft_length="fixed")
    steps = max(len(verifies) + plain for verifies, plain in zip(result.acceptance_lengths, result.plain_tokens))
    assert len(seen) == steps  # verify steps and plain steps (one token each)
    counts = np.stack(seen)  # [steps, batch]: tokens made so far
    assert (np.diff(counts, axis=0) >= 0).all() and counts[-1].tolist() == [len(t) for t in result.tokens]

    # Another budget of the same bucket and another callback run the programs already compiled.
    programs = generate_module._spec_prefill._cache_size(), generate_module._spec_decode._cache_size()
    other: list[np.ndarray] = []
    shorter = speculative_generate(target, drafter, [[5, 17, 99], [4]], max_new_tokens=7, progress=other.append,
                                   draft_length="fixed")
    assert (generate_module._spec_prefill._cache_size(), generate_module._spec_decode._cache_size()) == programs
    assert [len(t) for t in shorter.tokens] == [7, 7] and shorter.tokens == [t[:7] for t in result.tokens]
    assert other and len(seen) == steps  # the old one not called


def test_generate_verb_reports_bad_checkpoints(checkpoints, tmp_path, capsys):
    _, drafter_dir = checkpoints
    assert main(["generate", str(tmp_path), drafter_dir, "--prompt-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_generate_takes_hub_ids(checkpoints, tmp_path, capsys):
    """Offline (tests/_hub.py sets HF_HUB_OFFLINE=1 before huggingface_hub is imported); the same run as the
    first test, so that only the resolution is new."""
    target_dir, drafter_dir = checkpoints
    add_to_cache(tmp_path, "Qwen/tiny", directory_files(target_dir))
    add_to_cache(tmp_path, "org/tiny-drafter", directory_files(drafter_dir), revision="v1")
    args = ["--prompt-ids", "5,17,99", "--max-new-tokens", "12", "--dtype", "float32", "--draft-length", "fixed",
            "--cache-dir", str(tmp_path)]
    assert main(["generate", "Qwen/tiny", "org/tiny-drafter", "--drafter-revision", "v1", *args]) == 0
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    expected = greedy_generate(target, [5, 17, 99], max_new_tokens=12,
                               stop_token_ids=target.config.eos_token_ids).tokens[0]
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    assert main(["generate", "Qwen/tiny", "org/tiny-drafter", *args]) == 2  # no `main` ref for the drafter
    err = capsys.readouterr().err
    assert err.startswith("error: org/tiny-drafter: ") and "not in the hub cache" in err


def _bad_target(tmp_path, checkpoints, **changes):
    import json
    import shutil

    target_dir, _ = checkpoints
    bad = tmp_path / "target"
    shutil.copytree(target_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, **changes}))
    return str(bad)


@pytest.mark.parametrize("flags, words", [
    (["--prompt-ids", "5,128,17"], "dflash-jax generate: --prompt-ids[1] = 128 is outside the vocabulary [0, 128)"),
    (["--prompt-ids", "5", "--stop-token-ids", "1,9999"], "dflash-jax generate: --stop-token-ids[1] = 9999 is outside"),
    (["--prompt-ids", "5,6", "--max-new-tokens", "1000000000"],
     "a prompt of 2 tokens plus max_new_tokens=1000000000 reaches position 1000000002, beyond the target's "
     "max_position_embeddings=1024"),
])
def test_generate_refuses_ids_and_lengths_the_target_cannot_take(checkpoints, flags, words, capsys):
    target_dir, drafter_dir = checkpoints
    assert main(["generate", target_dir, drafter_dir, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {words}") and "Traceback" not in err


def test_generate_reports_a_target_config_that_is_a_directory(checkpoints, tmp_path, capsys):
    import shutil

    target_dir, drafter_dir = checkpoints
    shutil.copytree(target_dir, tmp_path / "t")
    os.remove(tmp_path / "t" / "config.json")
    os.mkdir(tmp_path / "t" / "config.json")
    assert main(["generate", str(tmp_path / "t"), drafter_dir, "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err


def test_generate_reports_zero_key_value_heads(checkpoints, tmp_path, capsys):
    _, drafter_dir = checkpoints
    bad = _bad_target(tmp_path, checkpoints, num_key_value_heads=0)
    code = main(["generate", bad, drafter_dir, "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "num_key_value_heads" in err


def test_generate_does_not_hang_on_a_target_config_that_is_a_fifo(checkpoints, tmp_path, capsys):
    import shutil
    import threading

    target_dir, drafter_dir = checkpoints
    shutil.copytree(target_dir, tmp_path / "t")
    fifo = tmp_path / "t" / "config.json"
    os.remove(fifo)
    os.mkfifo(fifo)
    codes = []
    worker = threading.Thread(target=lambda: codes.append(main(["generate", str(tmp_path / "t"), drafter_dir,
                                                                 "--prompt-ids", "1"])), daemon=True)
    worker.start()
    worker.join(1)
    if worker.is_alive():  # blocked in open(): give it an empty writer, so that the thread ends
        with open(fifo, "wb"):
            pass
        worker.join(10)
        pytest.fail("the CLI blocked on a FIFO config.json")
    assert codes == [2] and "config.json" in capsys.readouterr().err


def run_generate(argv: list[str], decode) -> int:
    """The `generate` verb of `argv` with `decode` in place of `speculative_generate` (`cli.generate`'s argument)."""
    return cli.generate(cli.parser().parse_args(["generate", *argv]), decode=decode)


def test_without_a_terminal_no_progress_callback_enters_the_loop(checkpoints, capsys):
    """The bar's callback would keep the decode loop out of JAX's persistent cache (host callbacks are not
    stored): off a terminal (here, captured output) none is passed. At the fixed draft length: the program of
    `test_generate_verb_prints_the_greedy_continuation`, none compiled here."""
    seen = []
    target_dir, drafter_dir = checkpoints
    assert run_generate([target_dir, drafter_dir, "--prompt-ids", "5, 17,99", "--max-new-tokens", "12",
                         "--dtype", "float32", "--draft-length", "fixed"],
                        lambda *args, **kw: seen.append(kw["progress"]) or speculative_generate(*args, **kw)) == 0
    assert seen == [None]


def test_generate_reports_an_absurd_layer_count(checkpoints, tmp_path, capsys):
    _, drafter_dir = checkpoints
    code = main(["generate", _bad_target(tmp_path, checkpoints, num_hidden_layers=10**12), drafter_dir,
                 "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "num_hidden_layers" in err


def keywords_seen(argv: list[str]) -> dict:
    """The keyword arguments the `generate` verb of `argv` passes to `speculative_generate` (a stub in its place)."""
    seen: dict = {}

    def fake(target, drafter, prompt, **kwargs):
        seen.update(kwargs)
        return GenerationResult([[1]], [[1]], 0.0, 0.0, [0])

    assert run_generate(argv, fake) == 0
    return seen


def test_generate_passes_the_draft_length(checkpoints):
    """`--draft-length adaptive|fixed` reaches `speculative_generate` as `draft_length`; without it, None: the
    library's default for the temperature. `--stop-token-ids` reaches it as given; without it, None: the target's
    eos ids (`speculative_generate`'s default)."""
    target_dir, drafter_dir = checkpoints
    for flags, expected in (([], None), (["--draft-length", "fixed"], "fixed"),
                            (["--draft-length", "adaptive"], "adaptive")):
        seen = keywords_seen([target_dir, drafter_dir, "--prompt-ids", "5", *flags])
        assert seen["draft_length"] == expected and seen["stop_token_ids"] is None
    assert keywords_seen([target_dir, drafter_dir, "--prompt-ids", "5", "--stop-token-ids", "3,4"])[
        "stop_token_ids"] == [3, 4]


def test_generate_passes_the_attention_rule(checkpoints, capsys):
    """`--attention-rule` / `--draft-window` / `--draft-sinks` reach `speculative_generate` as its options;
    options `AttentionOptions` refuses are one error line."""
    target_dir, drafter_dir = checkpoints
    seen = keywords_seen([target_dir, drafter_dir, "--prompt-ids", "5", "--attention-rule", "zlab",
                          "--draft-window", "8", "--draft-sinks", "2"])
    assert seen["attention"] == AttentionOptions(causal=False, sliding_window=False, draft_window=8, draft_sinks=2)
    capsys.readouterr()
    assert main(["generate", target_dir, drafter_dir, "--prompt-ids", "5", "--draft-sinks", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: AttentionOptions.draft_sinks=2 needs a draft_window")
    with pytest.raises(SystemExit) as e:  # argparse's own error line and exit status 2
        main(["generate", target_dir, drafter_dir, "--prompt-ids", "5", "--draft-sinks", "-1"])
    assert e.value.code == 2 and "--draft-sinks: -1 is negative" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", target_dir, drafter_dir, "--prompt-ids", "5", "--draft-length", "0.5"])
    assert e.value.code == 2 and "--draft-length: invalid choice: '0.5'" in capsys.readouterr().err


def test_generate_on_a_tensor_parallel_mesh(checkpoints, capsys):
    """`--tensor-parallel 2`: the target split over a (1, 2) ("data", "model") mesh, the DSpark drafter replicated
    on the same two devices; with `--confidence-threshold` the tokens are still the single-device greedy ones. At
    the fixed draft length (one verify program to compile): the adaptive one over several devices is
    test_multihost's."""
    seen = {}

    def spy(target, drafter, prompt, **kwargs):
        seen.update(target=target, drafter=drafter, **kwargs)
        return speculative_generate(target, drafter, prompt, **kwargs)

    target_dir, drafter_dir = checkpoints
    assert run_generate([target_dir, drafter_dir, "--prompt-ids", "5,17,99", "--max-new-tokens", "12",
                         "--dtype", "float32", "--tensor-parallel", "2", "--confidence-threshold", "0.6",
                         "--draft-length", "fixed"], spy) == 0
    target = Qwen3Target.from_pretrained(target_dir, dtype=jnp.float32)
    expected = greedy_generate(target, [5, 17, 99], max_new_tokens=12,
                               stop_token_ids=target.config.eos_token_ids).tokens[0]
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
    head = seen["target"].lm_head.sharding
    assert dict(head.mesh.shape) == {"data": 1, "model": 2} and "model" in head.spec
    fc = seen["drafter"].params["fc"]["weight"].sharding
    assert fc.mesh == head.mesh and fc.is_fully_replicated
    assert seen["confidence_threshold"] == 0.6


def test_generate_passes_the_sampling_controls(checkpoints, capsys):
    target_dir, drafter_dir = checkpoints
    seen = keywords_seen([target_dir, drafter_dir, "--prompt-ids", "5", "--temperature", "0.7", "--top-k", "20",
                          "--top-p", "0.9", "--min-p", "0.05", "--seed", "7"])
    assert {k: seen[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == dict(
        temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=7)
    for flag, value, words in (("--top-p", "0", "expected a number in (0, 1]"), ("--min-p", "1.5", "in [0, 1]"),
                               ("--top-k", "-1", "-1 is negative"), ("--tensor-parallel", "0", "not a positive"),
                               ("--confidence-threshold", "nan", "expected a finite number >= 0")):
        with pytest.raises(SystemExit) as e:
            main(["generate", target_dir, drafter_dir, "--prompt-ids", "5", flag, value])
        assert e.value.code == 2 and words in capsys.readouterr().err
    assert main(["generate", target_dir, drafter_dir, "--prompt-ids", "5", "--tensor-parallel", "64"]) == 2
    assert capsys.readouterr().err.startswith("error: --tensor-parallel 64: there are 8 device(s)")


def test_the_progress_display_shows_compiling_then_tokens():
    from dflash_jax.cli import progress_display

    display, report = progress_display(12, enabled=True)
    (task,) = display.tasks
    assert (task.description, task.completed) == ("compiling and prefilling", 0)
    report(np.array([3, 5]))
    assert (task.description, task.completed) == ("generating", 5)


def test_generate_verb_samples_at_a_temperature(checkpoints, capsys):
    """`--temperature 1 --seed N` reaches the sampler: a seed gives the same continuation twice, another seed
    another (12 tokens drawn over 128 ids by a random target: equal only by a near-impossible chance)."""
    target_dir, drafter_dir = checkpoints
    runs = []
    for seed in (3, 3, 4):
        code = main(["generate", target_dir, drafter_dir, "--prompt-ids", "5,17,99", "--max-new-tokens", "12",
                     "--dtype", "float32", "--temperature", "1", "--seed", str(seed), "--stop-token-ids", "127"])
        out, err = capsys.readouterr()
        assert code == 0 and "mean acceptance length" in err
        runs.append([int(t) for t in out.strip().split(",")])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2], runs
    assert all(0 <= t < 128 for r in runs for t in r) and all(len(r) == 12 or r[-1] == 127 for r in runs)
