"""Against Hugging Face transformers (optional extra `reference`: torch + transformers; skipped without them).

The same tiny float32 Qwen3 checkpoint is loaded by `Qwen3ForCausalLM` and by `Qwen3Target`: logits and every
`output_hidden_states` entry agree (including transformers' last entry, taken after the final norm), and
transformers' greedy `generate` equals `greedy_generate` and `speculative_generate` token for token. The same
for Llama 3 (`LlamaForCausalLM` against `load_target`, `llama3` RoPE in both config layouts, tensor-parallel).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from dflash_jax import load_drafter, load_target  # noqa: E402
from dflash_jax._qwen3_testing import write_qwen3_checkpoint  # noqa: E402
from dflash_jax.generate import greedy_generate, speculative_generate  # noqa: E402
from dflash_jax.target.dense import Qwen3Target  # noqa: E402
from dflash_jax.testing import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.reference

PROMPTS = [[5, 17, 99, 3], [120], [9, 9, 9, 9, 1, 2, 44, 100, 7, 61, 30], [64, 65, 66]]
MAX_NEW = 20


def _pair(directory, preset):
    write_qwen3_checkpoint(directory, preset, seed=4, dtype="float32")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return hf, Qwen3Target.from_pretrained(directory, dtype=jnp.float32)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-tied"])
def test_logits_and_hidden_states(tmp_path, preset):
    hf, target = _pair(tmp_path, preset)
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt]), output_hidden_states=True)
    layers = tuple(range(-1, target.config.num_hidden_layers))  # every entry: embedding .. last (normed)
    out = target(jnp.asarray([prompt]), target.init_cache(1, 16), jnp.zeros(1, jnp.int32), layer_ids=layers)
    np.testing.assert_allclose(np.asarray(out.logits[0]), expected.logits[0].numpy(), rtol=0, atol=1e-4)
    H = target.config.hidden_size
    for j, l in enumerate(layers):
        np.testing.assert_allclose(
            np.asarray(out.features[0, :, j * H : (j + 1) * H]), expected.hidden_states[l + 1][0].numpy(),
            rtol=0, atol=1e-4, err_msg=f"layer id {l} (hidden_states[{l + 1}])",
        )


def _generation_equals_transformers(hf, target, drafter):
    """Greedy and speculative tokens of every prompt equal `hf.generate`'s greedy ones (stopping at eos)."""
    eos = list(target.config.eos_token_ids)
    ours = greedy_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=eos).tokens
    speculative = speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=eos).tokens
    for prompt, mine, spec in zip(PROMPTS, ours, speculative):
        with torch.no_grad():
            generated = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])
        expected = generated[0, len(prompt):].tolist()
        assert mine == expected and spec == expected


def test_greedy_generate_equals_transformers(tmp_path):
    hf, target = _pair(tmp_path / "target", "tiny-qwen3")
    write_checkpoint(tmp_path / "drafter", "tiny-dflash", seed=3)
    drafter = load_drafter(tmp_path / "drafter", dtype=jnp.float32)
    _generation_equals_transformers(hf, target, drafter)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-v5", "tiny-llama-tied"])
def test_llama_equals_transformers(tmp_path, preset):
    """Float32 logits on one device, greedy tokens tensor-parallel over 4 devices (2 KV heads replicated)."""
    write_qwen3_checkpoint(tmp_path / "target", preset, seed=4, dtype="float32")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    target = load_target(tmp_path / "target", dtype=jnp.float32)
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
    out = target(jnp.asarray([prompt]), target.init_cache(1, 16), jnp.zeros(1, jnp.int32))
    np.testing.assert_allclose(np.asarray(out.logits[0]), expected, rtol=0, atol=1e-4)

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharded = load_target(tmp_path / "target", mesh=mesh, dtype=jnp.float32)
    write_checkpoint(tmp_path / "drafter", "tiny-dflash", seed=3)
    drafter = load_drafter(tmp_path / "drafter", mesh=mesh, dtype=jnp.float32)
    _generation_equals_transformers(hf, sharded, drafter)
