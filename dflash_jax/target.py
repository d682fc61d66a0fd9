"""The target side of speculative decoding: a `Target` protocol and `Qwen3Target`, a dense Qwen3 decoder in JAX.

`Qwen3Target.from_pretrained(path)` reads a Hugging Face Qwen3 directory (config.json + safetensors, sharded or
not) with the package's header-first reader and puts the weights on devices with `placement.place_all`, the
drafter's loader path. The forward runs the new tokens of each sequence against a static-shape KV cache and
returns, besides the final hidden states, the target features a DFlash-family drafter reads (spec §1.2, §7):

    feature l = transformers' hidden_states[l + 1]   the output of decoder layer l, for 0 <= l < N - 1
    feature N - 1 = hidden_states[N]                 the LAST layer's output AFTER the final norm
    feature -1 = hidden_states[0]                    the embedding output (DeepSpec)

concatenated shallow-to-deep in `layer_ids` order: `[batch, S, Lf * H]`.

KV cache: `KVCache(k, v)`, each `[L, batch, n_kv, T, d_h]`; slot t holds position t. The cache itself carries
no length: the caller keeps `lengths [batch]` (tokens committed per sequence). A forward over `S` new tokens
writes their K/V at slots `lengths .. lengths + S - 1` (their positions) and attends causally over slots
`< lengths + S`, so slots beyond a sequence's length are never read: trimming the cache to an accepted prefix
is just passing a smaller length next time (the rejected slots are overwritten). Sequences of a batch may have
different lengths; prompts of different lengths are right-padded.

Parameter tree (`Qwen3Target.params`): HF names with `model.` stripped, as the drafter's (docs/design.md):
`from_pretrained` gives `params["layers"]` as a tuple of per-layer dicts (each weight its own buffer, as placed),
run unrolled, every matmul reading its weights in place. The layers may also be STACKED, one dict of `[L, ...]`
arrays (`random_qwen3` draws them so): the forward then runs them with `lax.scan`, whose compile time does not
grow with depth, but whose per-step slice of a stacked weight XLA materialises (3x the weight traffic of a
decode step); `Qwen3Target.per_layer()` converts, and the generation loops do so themselves.

Shared with the drafter's forward (`model.py`): `linear`, `rms_norm`, `lm_logits`, the RoPE tables (float32 angles
as transformers) and `attend` (GQA, float32 softmax). `Qwen3Config` has the attributes `rope_frequencies` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import msgspec

from .config import RopeScaling, declared_rope_type, normalise_raw
from .errors import CheckpointError, ConfigError
from .loader import TensorPlan, build_tree, check_tensor
from .model import KeyValues, LayerRule, apply_rope, attend, linear, lm_logits, rms_norm, rope_tables
from .safetensors import Checkpoint

log = logging.getLogger("dflash_jax")

Params = dict[str, Any]


# --------------------------------------------------------------------------------------------------------------
# The protocol the speculative loop needs
# --------------------------------------------------------------------------------------------------------------


class KVCache(NamedTuple):
    """A static-shape KV cache: `k`, `v` `[L, batch, n_kv, T, d_h]` (post k_norm + RoPE keys; heads-major as
    `model.KeyValues`); slot t = position t."""

    k: jax.Array
    v: jax.Array


class TargetOutput(NamedTuple):
    """What one target forward returns."""

    logits: jax.Array  # [batch, S, V] float32
    features: jax.Array  # [batch, S, Lf * H] at the requested layer ids, shallow to deep
    cache: Any  # the cache with the new tokens' K/V written


@runtime_checkable
class Target(Protocol):
    """A causal LM that `speculative_generate` can verify drafts with.

    Requirements:
    - It is a JAX pytree (arrays as leaves, configuration as static metadata), so it is passed through `jax.jit`
      as an argument rather than baked into the program as constants.
    - `vocab_size`: the size of the logits' last axis; `embed`, `lm_head`: `[V, H]` in HF layout, handed to
      `drafter.attach` (DFlash drafters use the target's embedding and LM head).
    - `init_cache(batch, max_length)`: an empty cache pytree for up to `max_length` positions per sequence.
    - `__call__(tokens, cache, lengths, *, layer_ids)`: run `tokens [batch, S]` at positions
      `lengths[b] .. lengths[b] + S - 1`, attending to the first `lengths[b]` cached positions and causally
      among the new ones; return `TargetOutput` (logits and features for every new token, the updated cache).
      Cache entries at positions `>= lengths[b] + S` must never influence the result: the loop trims a cache to
      an accepted prefix by passing a smaller `lengths` next time.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def embed(self) -> jax.Array: ...

    @property
    def lm_head(self) -> jax.Array: ...

    def init_cache(self, batch_size: int, max_length: int) -> Any: ...

    def __call__(
        self, tokens: jax.Array, cache: Any, lengths: jax.Array, *, layer_ids: tuple[int, ...]
    ) -> TargetOutput: ...


# --------------------------------------------------------------------------------------------------------------
# Qwen3 config
# --------------------------------------------------------------------------------------------------------------


class Qwen3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The fields of a Hugging Face Qwen3 `config.json` the forward reads (defaults: transformers' Qwen3Config).

    Frozen and hashable: a static `jax.jit` argument. Also satisfies what `model.rope_frequencies` reads
    (`head_dim`, `rope_theta`, `rope_type`, `rope_scaling`, `max_position_embeddings`).
    """

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    use_sliding_window: bool = False
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    @property
    def rope_type(self) -> str:
        return "yarn" if declared_rope_type(self.rope_scaling) == "yarn" else "default"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple (configs state one id or a list)."""
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def parse_qwen3_config(raw: dict[str, Any], *, source: str = "<config>") -> Qwen3Config:
    """Decode a Qwen3 config dict (transformers 4 `rope_theta`/`rope_scaling` or 5 `rope_parameters` layout)."""
    try:
        config = msgspec.convert(normalise_raw(raw, source), Qwen3Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None
    problems = []
    if config.model_type not in (None, "qwen3"):
        problems.append(f"model_type is {config.model_type!r}, expected 'qwen3' (a dense Qwen3 decoder)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r}; only 'silu' (SwiGLU) is implemented")
    if config.num_attention_heads % config.num_key_value_heads:
        problems.append(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.use_sliding_window:
        problems.append("use_sliding_window=true is not implemented (released Qwen3 dense models leave it off)")
    if declared_rope_type(config.rope_scaling) not in ("default", "yarn"):
        problems.append(f"rope type {declared_rope_type(config.rope_scaling)!r}; only default and yarn are implemented")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return config


def load_qwen3_config(path: str | os.PathLike[str]) -> Qwen3Config:
    """Read `config.json` from a Qwen3 checkpoint directory."""
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file, "rb") as f:
            raw = msgspec.json.decode(f.read())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json; expected a Hugging Face Qwen3 checkpoint directory") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level")
    return parse_qwen3_config(raw, source=file)


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------

def _layer_shapes(c: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Per-layer tensors by their name inside `model.layers.{i}.`, with their shapes."""
    H, I, d_h = c.hidden_size, c.intermediate_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * d_h, c.num_key_value_heads * d_h
    shapes = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q_dim, H),
        "self_attn.k_proj.weight": (kv_dim, H),
        "self_attn.v_proj.weight": (kv_dim, H),
        "self_attn.o_proj.weight": (H, q_dim),
        "self_attn.q_norm.weight": (d_h,),
        "self_attn.k_norm.weight": (d_h,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }
    if c.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,),
                   "self_attn.v_proj.bias": (kv_dim,), "self_attn.o_proj.bias": (H,)}
    return shapes


def plan_qwen3(config: Qwen3Config) -> list[TensorPlan]:
    """Every tensor a Qwen3 checkpoint of `config` holds, with its tree path (per layer; stacked after placing).

    `lm_head.weight` is planned unless the embeddings are tied (a tied checkpoint may still carry a copy:
    it is then ignored, as transformers does).
    """
    c = config
    plan = [
        TensorPlan(("embed_tokens", "weight"), "model.embed_tokens.weight", (c.vocab_size, c.hidden_size), "float"),
        TensorPlan(("norm", "weight"), "model.norm.weight", (c.hidden_size,), "float"),
    ]
    if not c.tie_word_embeddings:
        plan.append(TensorPlan(("lm_head", "weight"), "lm_head.weight", (c.vocab_size, c.hidden_size), "float"))
    for i in range(c.num_hidden_layers):
        for name, shape in _layer_shapes(c).items():
            path = ("layers", i, *name.split("."))
            plan.append(TensorPlan(path, f"model.layers.{i}.{name}", shape, "float"))
    return plan


# --------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3Target:
    """A dense Qwen3 decoder (RMSNorm, per-head q/k norm, GQA, RoPE, SwiGLU, tied or untied embeddings).

    A pytree (params as leaves, config static): pass it whole through `jax.jit`. Implements `Target`.
    """

    params: Params
    config: Qwen3Config = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        mesh: jax.sharding.Mesh | None = None,
        dtype: jnp.dtype = jnp.bfloat16,
        progress: bool | None = None,
    ) -> Qwen3Target:
        """Load a Hugging Face Qwen3 directory: config.json + `model.safetensors` or an index with shards.

        Floating tensors are cast to `dtype`; with `mesh` every leaf is replicated over it (as the drafter's),
        without it they land on the first local device. Every tensor's presence, dtype and shape is checked
        against the config before any data is read (`CheckpointError` otherwise).
        """
        from .placement import place_all

        path = os.fspath(path)
        config = load_qwen3_config(path)
        with Checkpoint(path) as checkpoint:
            plan = plan_qwen3(config)
            for t in plan:
                check_tensor(t, checkpoint, path)
            leaves = place_all(plan, checkpoint, set(), mesh=mesh, dtype=dtype, progress=progress)
        params = build_tree(plan, leaves)
        params["layers"] = tuple(params["layers"])  # one buffer per weight, as placed: the decode form
        log.info(
            "%s: Qwen3 target, %d layers, hidden=%d, heads=%d/%d, vocab=%d, %s embeddings",
            path, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size, "tied" if config.tie_word_embeddings else "untied",
        )
        return cls(params=params, config=config)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embed(self) -> jax.Array:
        """The input embedding `[V, H]` (HF layout), for `drafter.attach(embed=...)`."""
        return self.params["embed_tokens"]["weight"]

    @property
    def lm_head(self) -> jax.Array:
        """The LM head `[V, H]` (HF layout; the embedding when tied), for `drafter.attach(lm_head=...)`."""
        own = self.params.get("lm_head")
        return self.embed if own is None else own["weight"]

    def per_layer(self) -> Qwen3Target:
        """This target with its decoder layers' weights as one buffer per layer (`params["layers"]` a tuple of
        per-layer dicts) instead of stacked `[L, ...]` arrays; itself if they already are.

        The form for a decode loop. With stacked weights the forward scans over the layers and every step
        slices its layer's weights out of the stack, which XLA materialises: each weight is read, written and
        read again per forward (3x the weight traffic of a memory-bound decode step). With per-layer buffers
        the forward is unrolled and every matmul reads its weights in place. The generation loops call this
        inside their jitted program, before their `while_loop` (one copy of the layers per call, alive during
        the loop); call it once up front (and drop the stacked target) to avoid the copy and the extra memory.
        """
        layers = self.params["layers"]
        if isinstance(layers, (list, tuple)):
            return self
        split = tuple(jax.tree.map(lambda w, i=i: w[i], layers) for i in range(self.config.num_hidden_layers))
        return dataclasses.replace(self, params={**self.params, "layers": split})

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences of up to `max_length` positions, in the params' dtype."""
        c = self.config
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_length, c.head_dim)
        return KVCache(jnp.zeros(shape, self.embed.dtype), jnp.zeros(shape, self.embed.dtype))

    def __call__(
        self, tokens: jax.Array, cache: KVCache, lengths: jax.Array, *, layer_ids: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run `tokens [batch, S]` after `lengths [batch]` cached positions (see the module docstring).

        Returns float32 logits `[batch, S, V]`, the features at `layer_ids` `[batch, S, len(layer_ids) * H]`
        (transformers' hidden_states[l + 1] convention) and the cache with the new K/V written. The caller must
        leave room: `lengths + S <= T` (writes past the cache's end are dropped).
        """
        return _forward(self, tokens, cache, lengths, tuple(layer_ids))


# --------------------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------------------

_CAUSAL = LayerRule(causal=True, window=None)


@functools.partial(jax.jit, static_argnames=("layer_ids",))
def _forward(
    target: Qwen3Target, tokens: jax.Array, cache: KVCache, lengths: jax.Array, layer_ids: tuple[int, ...]
) -> TargetOutput:
    params, c = target.params, target.config
    eps, N = c.rms_norm_eps, c.num_hidden_layers
    for l in layer_ids:
        if not -1 <= l < N:
            raise ValueError(f"target layer id {l} is outside [-1, {N - 1}] for a {N}-layer target")
    batch, S = tokens.shape
    T = cache.k.shape[3]
    dtype = target.embed.dtype

    lengths = lengths.astype(jnp.int32)
    positions = lengths[:, None] + jnp.arange(S, dtype=jnp.int32)  # [batch, S]
    rope = rope_tables(c, positions)  # cos/sin [batch, S, d_h]
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))  # [batch, T]: slot t = position t
    written = slots < (lengths + S)[:, None]  # [batch, T]
    rows = jnp.arange(batch)[:, None]  # [batch, 1]

    x0 = jnp.take(target.embed, tokens, axis=0).astype(dtype)  # [batch, S, H]
    run_layers = _layers_unrolled if isinstance(params["layers"], (list, tuple)) else _layers_scanned
    x, k_cache, v_cache, by_id = run_layers(params["layers"], c, x0, cache, rope, positions, slots, written, rows,
                                            layer_ids)
    hidden = rms_norm(x, params["norm"]["weight"], eps)  # [batch, S, H]
    by_id = {-1: x0, N - 1: hidden} | by_id
    features = (
        jnp.concatenate([by_id[l] for l in layer_ids], axis=-1) if layer_ids else jnp.zeros((batch, S, 0), dtype)
    )
    return TargetOutput(lm_logits(hidden, target.lm_head), features, KVCache(k_cache, v_cache))



def _layer(p: Params, c: Qwen3Config, x, k_cache, v_cache, i, rope, positions, slots, written, rows):
    """Decoder layer `i` (a Python int or a traced index) with its weights `p`: `(x, k_cache, v_cache)`.

    The new K/V rows go into the stacked caches `[L, batch, n_kv, T, d_h]` in place (a scatter at layer `i`,
    lowered to a dynamic-update-slice of the new rows); attention then reads layer `i`'s `[batch, n_kv, T, d_h]`.
    """
    batch, S, _ = x.shape
    n_h, n_kv, d_h, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    attn = p["self_attn"]
    xn = rms_norm(x, p["input_layernorm"]["weight"], eps)
    q = linear(xn, attn["q_proj"]).reshape(batch, S, n_h, d_h)
    k = linear(xn, attn["k_proj"]).reshape(batch, S, n_kv, d_h)
    v = linear(xn, attn["v_proj"]).reshape(batch, S, n_kv, d_h)
    q = apply_rope(rms_norm(q, attn["q_norm"]["weight"], eps), rope)  # [batch, S, n_h, d_h]
    k = apply_rope(rms_norm(k, attn["k_norm"]["weight"], eps), rope)  # [batch, S, n_kv, d_h]
    # (i, rows, positions) broadcast to [batch, S], the sliced n_kv and d_h axes follow: k's own layout
    k_cache = k_cache.at[i, rows, :, positions].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[i, rows, :, positions].set(v.astype(v_cache.dtype), mode="drop")
    keys = KeyValues(k_cache[i], v_cache[i], slots, written)  # [batch, n_kv, T, d_h]
    a = attend(q, positions, [keys], _CAUSAL).reshape(batch, S, n_h * d_h)
    x = x + linear(a, attn["o_proj"])
    h = rms_norm(x, p["post_attention_layernorm"]["weight"], eps)
    mlp = p["mlp"]
    x = x + linear(jax.nn.silu(linear(h, mlp["gate_proj"])) * linear(h, mlp["up_proj"]), mlp["down_proj"])
    return x, k_cache, v_cache


def _layers_unrolled(layers, c, x0, cache, rope, positions, slots, written, rows, layer_ids):
    """Per-layer weights (a sequence of per-layer dicts): the layers unrolled, each reading its own buffers."""
    x, k_cache, v_cache = x0, cache.k, cache.v
    inner = {}  # features taken after decoder layer l < N - 1
    for i, p in enumerate(layers):
        x, k_cache, v_cache = _layer(p, c, x, k_cache, v_cache, i, rope, positions, slots, written, rows)
        if i in layer_ids and i < c.num_hidden_layers - 1:
            inner[i] = x
    return x, k_cache, v_cache, inner


def _layers_scanned(layers, c, x0, cache, rope, positions, slots, written, rows, layer_ids):
    """Stacked weights `[L, ...]`: the layers under `lax.scan` (compile time independent of depth). Each step
    slices its layer's weights out of the stack, which XLA materialises as a copy (see `per_layer`)."""
    N = c.num_hidden_layers
    inner = [l for l in layer_ids if 0 <= l < N - 1]  # features taken inside the scan
    inner_ids = jnp.asarray(inner if inner else [-2], jnp.int32)  # [n_inner]

    def layer(carry, inputs):
        x, k_cache, v_cache, feats = carry  # x [batch, S, H]; caches [L, batch, n_kv, T, d_h]
        p, i = inputs
        x, k_cache, v_cache = _layer(p, c, x, k_cache, v_cache, i, rope, positions, slots, written, rows)
        feats = jnp.where((inner_ids == i)[:, None, None, None], x[None], feats)  # [n_inner, batch, S, H]
        return (x, k_cache, v_cache, feats), None

    feats = jnp.zeros((len(inner_ids), *x0.shape), x0.dtype)
    (x, k_cache, v_cache, feats), _ = jax.lax.scan(
        layer, (x0, cache.k, cache.v, feats), (layers, jnp.arange(N, dtype=jnp.int32))
    )
    return x, k_cache, v_cache, {l: feats[j] for j, l in enumerate(inner)}
