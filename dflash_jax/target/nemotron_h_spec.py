"""The tensors of a Nemotron-H checkpoint (`target.nemotron_h`), declared once: HF name, shape from the config,
kind, logical axes for a tensor-parallel layout, initialiser (`spec.ParamSpec`).

Apart from the maths module because `dflash_jax.spec` imports the drafter config (`dflash_jax.config`), which the
pure maths must not reach.

Names are the checkpoint's (`backbone.` root, `lm_head.weight` beside it), except the routed experts: the checkpoint
stores one tensor per expert (`mixer.experts.{e}.up_proj.weight [I, H]`, `down_proj.weight [H, I]`), the tree holds
them stacked as `mixer.experts.up_proj [E, I, H]` / `down_proj [E, H, I]` (as `target.moe` stacks Qwen3.5's), and
this spec declares the stacks. Every block's mixer lives under the same `mixer.` prefix whatever its kind, so the
spec is given expanded, block by block (`parameter_spec`), or per kind (`block_spec`, `{i}` the block).

Logical axes (`spec`'s names; a `target.layout.Layout` maps HEADS, KV_HEADS, MLP, EXPERT_MLP and VOCAB onto the
tensor axis, EMBED and unnamed axes nowhere):

- attention as the dense target's: q by head, k / v by KV head (output rows), o by head (input columns);
- MLP blocks and the MoE block's shared expert Megatron-style over MLP (up by output, down by input); the routed
  expert stacks `(EXPERTS, EXPERT_MLP, EMBED)` / `(EXPERTS, EMBED, EXPERT_MLP)` as `moe.moe_parameter_spec`'s (each
  expert's width split, every device a slice of every expert); the router's weight and correction bias
  replicated (the choice must be the same on every device);
- embedding and LM head by the vocabulary; norms replicated;
- the Mamba-2 mixer by head. Checkpoints store `in_proj`'s output rows as five sections, `[z (d_inner) | x
  (d_inner) | B (G N) | C (G N) | dt (nh)]`, and `conv1d`'s channels (weight and bias) as three, `x | B | C`: a
  contiguous split of the stored rows would hand a device a slice of z and x but none of B, C or dt. The tree keeps
  ONE `in_proj` and one conv per block, their rows split over the tensor axis (`HEADS`) but permuted where the load
  reads them (`NemotronHTarget.views`, `mamba2.in_proj_order` / `conv_order`): device d's contiguous shard is
  `[z_d | x_d | B_d | C_d | dt_d]` (conv: `[x_d | B_d | C_d]`), the d-th block of each section, so that a device
  runs one product and one conv, as one device does (`mamba2.mixer` splits the result by static section sizes).
  z, x, dt, `dt_bias`, `A_log`, `D` and the gated norm's weight split by Mamba head, `out_proj` by input (an
  all-reduce after it, as after attention's `o_proj`). Where the tensor axis divides `n_groups`, device d's heads
  read exactly its B / C groups (head h reads group `h // (nh / G)`), and the gated norm's groups (`d_inner / G`
  channels each, transformers' `MambaRMSNormGated`) are its heads' channels: nothing crosses devices until
  `out_proj`'s sum. Where the axis is a multiple of `n_groups`, each group's B / C rows are spread over the
  `tp / G` devices of its heads: the B / C activations (`[batch, S, G N]`, no weight) are gathered within the
  step, and a norm group spans those devices (a sum across them). `NemotronHTarget.layout_for` needs the tensor
  axis to divide `mamba_num_heads` and to divide `n_groups` or be a multiple of it dividing `n_groups *
  ssm_state_size` (`ConfigError` naming the field). The cache state splits with its tensors: the conv state (its
  channels in the conv's order) and the SSM state by head (`MAMBA_CONV_AXES`, `MAMBA_SSM_AXES`), each by the
  batch too. With one device on the tensor axis the permutation is the identity: the checkpoint's tensors as
  stored.

Kinds: the projections `spec.LINEAR` (stored float, or quantized as ModelOpt's `MIXED_PRECISION` export of the
released NVFP4 target stores them: Mamba `in_proj` / `out_proj` FP8 W8A8, the routed and shared experts'
`up_proj` / `down_proj` and `lm_head` W4A16 NVFP4; `NemotronHTarget.stored_plan` reads that layout), the router's
weight and correction bias `spec.FLOAT32` (kept float32 in a bfloat16 load, as transformers'
`DeepseekV3TopkRouter` computes in float32 with a float32 bias buffer, and vLLM: the bias steers the choice of
experts in steps finer than bfloat16 resolves), every other tensor `spec.FLOAT`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..spec import (
    BATCH,
    EMBED,
    EXPERT_MLP,
    EXPERTS,
    FLOAT32,
    HEADS,
    KV_HEADS,
    LINEAR,
    NORM,
    VOCAB,
    Bias,
    Gain,
    ParamSpec,
)
from ..spec import MLP as MLP_AXIS
from .nemotron_h_config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig

__all__ = ["parameter_spec"]

ROOT = "backbone."  # the checkpoint's root of every tensor but `lm_head.weight`; the tree strips it
BLOCK = ROOT + "layers.{i}."
KV_AXES = (BATCH, KV_HEADS, None, None)  # an attention block's K or V `[batch, n_kv, T, d_h]` (`layout.CACHE_AXES`)
MAMBA_CONV_AXES = (BATCH, HEADS, None)  # `Mamba2State.conv [batch, conv_dim, K - 1]`, its channels in `conv_order`
MAMBA_SSM_AXES = (BATCH, HEADS, None, None)  # `Mamba2State.ssm [batch, nh, hd, N]`


@dataclasses.dataclass(frozen=True)
class LogUniform:
    """`log U(low, high)`: `A_log`, transformers' Mamba-2 decay rates A in [1, 16]."""

    low: float = 1.0
    high: float = 16.0

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.log(rng.uniform(self.low, self.high, shape)).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jnp.log(jax.random.uniform(key, shape, dtype, self.low, self.high))


@dataclasses.dataclass(frozen=True)
class TimeStepBias:
    """`dt_bias = softplus^-1(dt)`, dt log-uniform in `[time_step_min, time_step_max]` (transformers' init:
    Mamba-2's time steps at rest)."""

    low: float = 0.001
    high: float = 0.1

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        dt = np.exp(rng.uniform(np.log(self.low), np.log(self.high), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)

    def device(self, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, np.log(self.low), np.log(self.high)))
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def block_spec(c: NemotronHConfig, kind: str, prefix: str = BLOCK) -> list[ParamSpec]:
    """The tensors of one block of `kind` under `prefix` (`{i}`: the block): its norm, then its mixer's."""
    H = c.hidden_size
    mixer = prefix + "mixer."
    specs = [ParamSpec(prefix + "norm.weight", (H,), NORM, (EMBED,), Gain())]
    if kind == MAMBA:
        dims = c.mamba_dims
        nh = dims.heads
        specs += [
            ParamSpec(mixer + "in_proj.weight", (c.in_proj_rows, H), LINEAR, (HEADS, EMBED)),  # `in_proj_order`
            ParamSpec(mixer + "conv1d.weight", (dims.conv_dim, 1, dims.conv_kernel), axes=(HEADS, None, None)),
            ParamSpec(mixer + "conv1d.bias", (dims.conv_dim,), axes=(HEADS,), init=Bias()),  # both `conv_order`
            ParamSpec(mixer + "dt_bias", (nh,), axes=(HEADS,), init=TimeStepBias(c.time_step_min, c.time_step_max)),
            ParamSpec(mixer + "A_log", (nh,), axes=(HEADS,), init=LogUniform()),
            ParamSpec(mixer + "D", (nh,), axes=(HEADS,), init=Gain()),
            ParamSpec(mixer + "norm.weight", (dims.d_inner,), NORM, (HEADS,), Gain()),
            ParamSpec(mixer + "out_proj.weight", (H, dims.d_inner), LINEAR, (EMBED, HEADS)),
        ]
    elif kind == ATTENTION:
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs += [
            ParamSpec(mixer + "q_proj.weight", (q_dim, H), LINEAR, (HEADS, EMBED)),
            ParamSpec(mixer + "k_proj.weight", (kv_dim, H), LINEAR, (KV_HEADS, EMBED)),
            ParamSpec(mixer + "v_proj.weight", (kv_dim, H), LINEAR, (KV_HEADS, EMBED)),
            ParamSpec(mixer + "o_proj.weight", (H, q_dim), LINEAR, (EMBED, HEADS)),
        ]
    elif kind == MOE:
        E, I, Is = c.n_routed_experts, c.moe_intermediate_size, c.moe_shared_expert_intermediate_size
        specs += [
            ParamSpec(mixer + "gate.weight", (E, H), FLOAT32, axes=(None, EMBED)),
            ParamSpec(mixer + "gate.e_score_correction_bias", (E,), FLOAT32, axes=(None,), init=Bias()),
            ParamSpec(mixer + "experts.up_proj", (E, I, H), axes=(EXPERTS, EXPERT_MLP, EMBED)),
            ParamSpec(mixer + "experts.down_proj", (E, H, I), axes=(EXPERTS, EMBED, EXPERT_MLP)),
            ParamSpec(mixer + "shared_experts.up_proj.weight", (Is, H), LINEAR, (MLP_AXIS, EMBED)),
            ParamSpec(mixer + "shared_experts.down_proj.weight", (H, Is), LINEAR, (EMBED, MLP_AXIS)),
        ]
    elif kind == MLP:
        I = c.intermediate_size
        specs += [
            ParamSpec(mixer + "up_proj.weight", (I, H), LINEAR, (MLP_AXIS, EMBED)),
            ParamSpec(mixer + "down_proj.weight", (H, I), LINEAR, (EMBED, MLP_AXIS)),
        ]
    else:
        raise ValueError(f"block kind {kind!r}; expected one of {MAMBA!r}, {ATTENTION!r}, {MOE!r}, {MLP!r}")
    return specs


def parameter_spec(c: NemotronHConfig) -> list[ParamSpec]:
    """Every tensor of a checkpoint of `c` (the routed experts as stacks), in checkpoint order: the embedding, each
    block's (`block_spec`, `{i}` filled in), `norm_f`, then `lm_head` unless the embeddings are tied."""
    H = c.hidden_size
    specs = [ParamSpec(ROOT + "embeddings.weight", (c.vocab_size, H), axes=(VOCAB, EMBED))]
    for i, kind in enumerate(c.layers_block_type):
        specs += [s._replace(name=s.name.format(i=i)) for s in block_spec(c, kind)]
    specs.append(ParamSpec(ROOT + "norm_f.weight", (H,), NORM, (EMBED,), Gain()))
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (c.vocab_size, H), LINEAR, (VOCAB, EMBED)))
    return specs


def expert_tensors(c: NemotronHConfig, stack: str) -> list[str]:
    """The checkpoint's per-expert tensors a stack of the spec is made of: `...mixer.experts.up_proj` ->
    `...mixer.experts.{e}.up_proj.weight` for e = 0 .. E - 1."""
    prefix, _, proj = stack.rpartition(".")
    return [f"{prefix}.{e}.{proj}.weight" for e in range(c.n_routed_experts)]
