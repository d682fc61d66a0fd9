"""`repr` of a drafter and of a target: one short line (family, sizes, arrays, dtype, devices, bytes), not the
arrays' text (16 kB and 38 kB for the tiny models before)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax import load_drafter, load_target
from dflash_jax._qwen3_testing import write_qwen3_checkpoint
from dflash_jax.testing import random_drafter, write_checkpoint


def test_a_drafter_shows_a_summary(tmp_path, cpu_mesh):
    write_checkpoint(tmp_path, "tiny-dspark")
    drafter = load_drafter(tmp_path, mesh=cpu_mesh, dtype=jnp.float32)
    arrays = len(jax.tree.leaves(drafter))
    assert repr(drafter) == (f"Drafter(dspark, 2 layers, hidden 64, block 7, vocab 128, {arrays} arrays, float32, "
                             f"8 x cpu, {drafter.param_bytes / 1e3:.1f} kB)")
    attached = random_drafter("tiny-dflash")
    assert repr(attached).startswith("Drafter(dflash, 2 layers, hidden 64, block 8, vocab 128, target's embed and "
                                     "lm_head attached, ")
    assert len(repr(attached)) < 160 and str(attached) == repr(attached)
    inside = []
    jax.jit(lambda d: inside.append(repr(d)) or 0)(attached)
    assert "traced" in inside[0]  # under jit the leaves are tracers: no devices to name


def test_a_target_shows_a_summary(tmp_path):
    write_qwen3_checkpoint(tmp_path, "tiny-qwen3-tp", seed=1)
    mesh = jax.make_mesh((1, 2), ("data", "model"), devices=jax.devices()[:2])
    target = load_target(tmp_path, mesh=mesh, dtype=jnp.bfloat16)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
    text = repr(target)
    assert text.startswith("DecoderTarget(qwen3, 2 layers, hidden 64, vocab 128, mesh {'data': 1, 'model': 2}, ")
    assert text.endswith(f", bfloat16, 2 x cpu, {nbytes / 1e3:.1f} kB)") and len(text) < 160
