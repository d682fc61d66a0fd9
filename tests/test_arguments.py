"""Argument checks for the drafting entry points (issue 13 §8): shapes that disagree with the config, token
ids outside the vocabulary, temperatures without a key; values are checked only when the host sees them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax._arguments import check_block_inputs, check_propose_inputs, check_sampling, check_token_ids
from dflash_jax.config import parse_config
from dflash_jax.testing import TINY_CONFIGS

CONFIG = parse_config(TINY_CONFIGS["tiny-dflash"])  # H 64, 2 target layers, block 8, vocab 128
B, WIDTH, V = CONFIG.effective_block_size, 2 * CONFIG.hidden_size, CONFIG.vocab_size


def block_inputs(batch=2, rows=5, block=B, width=WIDTH):
    return (np.zeros((batch, rows, width), np.float32), np.zeros((batch, block), np.int32),
            np.zeros((batch, rows), np.int32), np.zeros((batch, block), np.int32))


def test_consistent_block_inputs_pass():
    check_block_inputs(CONFIG, "draft_logits", *block_inputs())


@pytest.mark.parametrize("change,says", [
    (lambda a: (a[0], a[1][:, :-1], a[2], a[3][:, :-1]),
     "block_ids has shape [2, 7], expected [2, 8] (the block size is 8)"),
    (lambda a: (a[0][..., :-1], *a[1:]), "target_hidden has shape [2, 5, 127], expected [batch, S, 128]"),
    (lambda a: (a[0], a[1], a[2][:, :-1], a[3]), "context_positions has shape [2, 4], expected [2, 5]"),
    (lambda a: (a[0], a[1], a[2], a[3][:1]), "block_positions has shape [1, 8]"),
    (lambda a: (a[0], np.full_like(a[1], V), a[2], a[3]), "block_ids[0, 0] = 128 is outside the vocabulary [0, 128)"),
    (lambda a: (a[0], np.full_like(a[1], -1), a[2], a[3]), "block_ids[0, 0] = -1 is outside"),
])
def test_block_inputs_that_disagree_with_the_config_are_refused(change, says):
    with pytest.raises(ValueError, match=re.escape("draft_logits: " + says)):
        check_block_inputs(CONFIG, "draft_logits", *change(block_inputs()))


def test_under_jit_shapes_are_checked_and_values_are_not():
    def f(hidden, ids, cpos, bpos):
        check_block_inputs(CONFIG, "draft_logits", hidden, ids, cpos, bpos)
        return ids

    jax.jit(f)(*block_inputs()[:1], np.full((2, B), V, np.int32), *block_inputs()[2:])  # traced ids: not seen
    with pytest.raises(ValueError, match="block_ids has shape"):
        jax.jit(f)(*block_inputs(block=B - 1)[:2], *block_inputs()[2:])


def test_propose_inputs():
    hidden, anchors, counts = np.zeros((2, 4, WIDTH), np.float32), np.array([3, 5]), np.array([4, 0])
    check_propose_inputs(CONFIG, "propose", 2, hidden, counts, anchors)
    for args, says in [
        ((3, hidden, counts, anchors), r"target_hidden has shape \[2, 4, 128\], expected \[3, n_new, 128\]"),
        ((2, hidden, counts[:1], anchors), r"num_new has shape \[1\], expected \[2\]"),
        ((2, hidden, np.array([5, 0]), anchors), r"num_new \[5, 0\] has entries outside \[0, 4\]"),
        ((2, hidden, np.array([-1, 0]), anchors), "num_new"),
        ((2, hidden, counts, np.array([3, 128])), r"anchor_ids\[1\] = 128 is outside"),
    ]:
        with pytest.raises(ValueError, match="propose: " + says):
            check_propose_inputs(CONFIG, "propose", *args)


def test_sampling():
    check_sampling("propose", None, 0.0)
    check_sampling("propose", jax.random.key(0), np.array([0.0, 0.7]))
    with pytest.raises(ValueError, match=r"propose: temperature \[0.0, 0.7\] > 0 without a key"):
        check_sampling("propose", None, np.array([0.0, 0.7]))
    for bad in (-0.1, np.nan, np.inf):
        with pytest.raises(ValueError, match="must be finite and >= 0"):
            check_sampling("propose", jax.random.key(0), bad)
    jax.jit(lambda t: check_sampling("propose", None, t) or t)(jnp.float32(1.0))  # traced: not checked


def test_token_ids_of_another_dtype_are_refused():
    with pytest.raises(ValueError, match="prompt_ids has dtype float32"):
        check_token_ids("generate", "prompt_ids", np.array([1.0], np.float32), V)
    check_token_ids("generate", "prompt_ids", [], V)


def test_cache_check_asks_only_this_process_devices():
    """Under `jax.distributed` the target's arrays span other processes' devices, which cannot report their memory
    (`memory_stats` raises for them): the check weighs this process's devices against their share."""
    import types

    from dflash_jax._arguments import check_cache_fits

    class Remote:  # another process's device, as jax shows it
        process_index = jax.process_index() + 1
        platform = "cpu"

        def memory_stats(self):
            raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")

    here = jax.local_devices()[0]
    embed = types.SimpleNamespace(devices=lambda: {here, Remote()})
    target = types.SimpleNamespace(embed=embed, init_cache=lambda batch, capacity: jnp.zeros((batch, capacity)))
    check_cache_fits("speculative_generate", target, None, 1, 128)
    with pytest.raises(ValueError, match="need .* GiB, but the target's 1 device"):
        check_cache_fits("speculative_generate", target, None, 2**16, 2**30)
