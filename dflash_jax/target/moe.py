"""The sparse mixture-of-experts block of Qwen3.5 / Qwen3.6 MoE (transformers `qwen3_5_moe`): pure model code.

    l = x @ gate.T                                       router logits, float32, over all E experts
    top, e = top_k(l, k);  w = softmax(top)              the k experts of each token, their weights renormalised
    y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))    routed experts (SwiGLU each)
      + sigmoid(x @ shared_expert_gate.T) * shared_expert(x)

as transformers 5.24.0 `models/qwen3_5_moe/modeling_qwen3_5_moe.py` (`Qwen3_5MoeSparseMoeBlock`) computes it.
Its router (`Qwen3_5MoeTopKRouter`) takes the top k of `softmax(l)` and renormalises them, which is the softmax of
the k largest logits: `route` takes that form (equal within float32 rounding; no softmax over all E). It always
renormalises: `qwen3_5_moe` configs have no `norm_topk_prob` (its modular file deletes the field), so a Qwen3.5
config passes `norm_topk_prob=True`; a config with `norm_topk_prob=False` gets `top_k(softmax(l), k)` unchanged.

The routed experts run one of two ways by default (`weighted_experts`), both reading only the experts the tokens
route to and computing about `tokens * k` rows, not `tokens * E`: for the few rows of decode and verify steps each
token's experts' weights are gathered (copied out, or read in place by a multiply-and-reduce, or each distinct expert
read once in place by a Mosaic GPU kernel: `tuning.Tuning.moe_few_rows`); for more, the pairs are sorted by expert
into tiles of one expert each and each tile multiplies its expert's weights (a grouped matmul in batched form). Every
shape is static.

Parameter tree of one block (`p`, the `mlp` subtree of a layer; HF names below the layer's `mlp.`):

    gate.weight                  [E, H]       the router
    experts.gate_proj            [E, I, H]    stacked per-expert weights, HF `[out, in]` orientation per expert
    experts.up_proj              [E, I, H]
    experts.down_proj            [E, H, I]
    shared_expert.gate_proj.weight  [Is, H]
    shared_expert.up_proj.weight    [Is, H]
    shared_expert.down_proj.weight  [H, Is]
    shared_expert_gate.weight    [1, H]

(E `num_experts`, I `moe_intermediate_size`, Is `shared_expert_intermediate_size`.) Released checkpoints store
`experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj`; others one tensor per expert.
`target.experts.ExpertStacks` reads either as this tree's stacks.

The routed-expert machinery (`weighted_experts` and its forms) also runs experts without a gate: stacks with no
`experts.gate_proj` are relu^2 experts, `down_e(relu(up_e(x))^2)` (Nemotron-H's, `target.nemotron_h`, which routes
them with its own sigmoid router and passes `weighted_experts` in).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp

from .._precision import precision
from .._shapes import ceil_div, round_up
from ..errors import ConfigError
from ..layers import dot, linear
from ..platform import Platform, on_gpu, process_platform
from ..spec import EMBED, EXPERT_MLP, EXPERTS, MLP, ParamSpec
from ._expert_gemm import MIN_COLUMNS, expert_matmul, slots_of, takes

__all__ = ["MoeConfig", "MoeDims", "moe_block", "route", "routed_experts", "weighted_experts", "gated_shared_expert",
           "Impl", "IMPLS"]

Params = dict[str, Any]
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's SwiGLU weights (a relu^2 expert: no gate_proj)


class MoeConfig(Protocol):
    """The config fields the block reads; any config object that has them serves (`MoeDims`, a family's config)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def shared_expert_intermediate_size(self) -> int: ...
    @property
    def norm_topk_prob(self) -> bool: ...


MOE_FIELDS = ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def check_moe_config(c: MoeConfig, source: str) -> None:
    """Refuse sizes the block cannot run: a `ConfigError` naming `source` and the field."""
    for field in MOE_FIELDS:
        value = getattr(c, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{source}: {field}={value!r}; expected a positive integer")
    if c.num_experts_per_tok > c.num_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}; expected "
            "each token to route to at most every expert"
        )


@dataclasses.dataclass(frozen=True)
class MoeDims:
    """The sizes of one MoE block (hashable: static under `jax.jit`), checked on construction (`ConfigError`).

    Defaults: Qwen3.5-35B-A3B's (transformers 5.24.0 `Qwen3_5MoeTextConfig`)."""

    hidden_size: int = 2048
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        check_moe_config(self, type(self).__name__)


def moe_parameter_spec(c: MoeConfig, prefix: str = "model.layers.{i}.mlp.") -> list[ParamSpec]:
    """The tensors of one MoE block under `prefix` (`{i}`: the layer), as the tree holds them (module docstring).

    Logical axes: the router and the shared-expert gate replicated; the shared expert Megatron-style over `MLP`
    (gate/up by output, down by input), as a dense MLP; the expert stacks over `EXPERTS` (dim 0) and each expert's
    width `EXPERT_MLP`. A layout maps at most one of those two onto a mesh axis: `target.layout.Layout` splits
    `EXPERT_MLP` over the tensor axis (every device a slice of every expert: a step's reads are balanced whatever
    the routing) and keeps `EXPERTS` whole. Measured on 8 CPU devices (where `ragged_dot` lowers to JAX's dense
    expansion): GSPMD gathers no weights and all-reduces after the down projections, as for a dense MLP.
    """
    H, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    shared = prefix + "shared_expert."
    return [
        ParamSpec(prefix + "gate.weight", (E, H), axes=(None, EMBED)),
        ParamSpec(prefix + "experts.gate_proj", (E, I, H), axes=(EXPERTS, EXPERT_MLP, EMBED)),
        ParamSpec(prefix + "experts.up_proj", (E, I, H), axes=(EXPERTS, EXPERT_MLP, EMBED)),
        ParamSpec(prefix + "experts.down_proj", (E, H, I), axes=(EXPERTS, EMBED, EXPERT_MLP)),
        ParamSpec(shared + "gate_proj.weight", (Is, H), axes=(MLP, EMBED)),
        ParamSpec(shared + "up_proj.weight", (Is, H), axes=(MLP, EMBED)),
        ParamSpec(shared + "down_proj.weight", (H, Is), axes=(EMBED, MLP)),
        ParamSpec(prefix + "shared_expert_gate.weight", (1, H), axes=(None, EMBED)),
    ]


def route(p: Params, c: MoeConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The router over tokens `x [T, H]`: `(weights [T, k] float32, experts [T, k] int32)`, by descending weight.

    Logits and softmax in float32 (transformers computes the logits in the weights' dtype, then the softmax in
    float32); top-k of the probabilities, renormalised to sum to 1 when `norm_topk_prob`. Renormalised, the k
    weights are the softmax of the k largest logits, and softmax keeps the order, so that case takes the top-k of
    the logits and never normalises over all E (one kernel fewer a block on the GPU; equal to transformers' weights
    within float32 rounding, and the same experts unless two logits differ by less than their probabilities
    resolve).
    """
    logits = dot("th,eh->te", x, p["gate"]["weight"])  # [T, E] float32
    if c.norm_topk_prob:
        top, experts = jax.lax.top_k(logits, c.num_experts_per_tok)  # [T, k]
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), c.num_experts_per_tok)  # [T, k]
    return weights, experts.astype(jnp.int32)


def routed_experts(p: Params, c: MoeConfig, x: jax.Array) -> jax.Array:
    """The experts each token of `x [batch, S, H]` routes to: `[batch, S, k]` int32, by descending weight."""
    batch, S, H = x.shape
    return route(p, c, x.reshape(batch * S, H))[1].reshape(batch, S, -1)


# The routed experts, several ways (docs/benchmarks.md, benchmarks/moe_block.py): gathering each token's experts is
# the fastest for the rows of decode and verify steps, up to `tuning.Tuning.moe_gather_max_rows` (token, expert)
# pairs (`_gathered` or `_gathered_in_place`, `tuning.Tuning.moe_few_rows`); beyond, the pairs go in tiles of one
# expert each (`_tiled`). XLA's `ragged_dot` reads every expert's
# weights, and on the GPU a 2048-token prefill chunk of the 35B-A3B through it ran the H200 out of memory beside
# the 65 GiB target (an 18 GiB allocation).


def _hidden(stacks: Params, product: Callable[[str], jax.Array]) -> jax.Array:
    """An expert's hidden activation from its input products `product(name)` with the stacks `name` of `stacks`
    (float32; `_grouped`'s in the rows' dtype): SwiGLU `silu(gate) * up`, or where there is no `gate_proj` the
    relu^2 experts' `relu(up)^2`."""
    if "gate_proj" in stacks:
        return jax.nn.silu(product("gate_proj")) * product("up_proj")
    return jnp.square(jax.nn.relu(product("up_proj")))


def _gathered(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Each token's k experts' weights gathered (`[T, k, out, in]`, a copy of only the routed slices) and applied
    as batched matrix-vector products: `[T, H]` float32. No sort, no pass over unrouted experts."""
    e = {name: jnp.take(w, experts, axis=0) for name, w in p["experts"].items()}
    h = _hidden(e, lambda name: dot("th,tkih->tki", x, e[name]))  # [T, k, I] float32
    out = dot("tki,tkhi->tkh", h.astype(x.dtype), e["down_proj"])  # [T, k, H] float32
    return jnp.einsum("tkh,tk->th", out, weights)


def _gathered_in_place(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """`_gathered` with the products written as a multiply and a float32 sum over the weights' contiguous last axis:
    XLA fuses a gather into the reduction that consumes it, so each routed slice is read once, where it lies,
    instead of copied out (`[T, k, out, in]`, written then read again) for a matmul. `[T, H]` float32."""
    # [T, k, out, in] each, not copied; "clip": XLA's own gather semantics (router indices are in range), no mask
    e = {name: jnp.take(w, experts, axis=0, mode="clip").astype(jnp.float32) for name, w in p["experts"].items()}
    xf = x.astype(jnp.float32)[:, None, None, :]  # [T, 1, 1, H]
    h = _hidden(e, lambda name: jnp.sum(e[name] * xf, axis=-1))  # [T, k, I] float32
    h = h.astype(x.dtype).astype(jnp.float32)[:, :, None, :]  # [T, k, 1, I] rounded as `_gathered` rounds it
    return jnp.einsum("tkh,tk->th", jnp.sum(e["down_proj"] * h, axis=-1), weights)  # [T, k, H] -> [T, H]


def _slotted(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, interpret: bool = False,
             platform: Platform | None = None) -> jax.Array:
    """Each distinct routed expert's weights read once, in place, by the Mosaic GPU kernel (`_expert_gemm`), for
    all T tokens as its columns; each (token, expert) pair takes its own column: `[T, H]` float32, rounded as
    `_gathered` rounds (h to x's dtype between the products). `platform`: the kernel's depth and SMs (default
    `platform.process_platform()`)."""
    T, k = experts.shape
    P, N = T * k, round_up(T, MIN_COLUMNS)  # N: the kernel's columns, the tokens padded
    if T == 1:  # one token's k experts are distinct: each pair is its own slot, no sort
        slot_expert, used, slot_of = experts.reshape(P), jnp.asarray(P), jnp.arange(P, dtype=jnp.int32)
    else:
        slot_expert, used, slot_of = slots_of(experts.reshape(P))  # [P], [], [P]
    token = jnp.arange(P) // k  # [P] pair t * k + j is token t's
    e = p["experts"]
    here = platform or process_platform()
    matmul = functools.partial(expert_matmul, depth=here.tuning.expert_gemm_depth, sms=here.sm_count,
                               interpret=interpret)

    def pairs(partials: jax.Array) -> jax.Array:  # [splits, S, out, N] -> [P, out]: each pair's slot and token
        return partials.sum(0)[slot_of, :, token]

    xt = jnp.pad(x, ((0, N - T), (0, 0))).T  # [H, N]
    h = _hidden(e, lambda name: pairs(matmul(xt, e[name], slot_expert, used)))
    h = h.astype(x.dtype)  # [P, I]
    rhs = jnp.zeros((P, h.shape[1], N), x.dtype).at[slot_of, :, token].set(h, unique_indices=True)  # [S, I, N]
    out = pairs(matmul(rhs, e["down_proj"], slot_expert, used))
    return jnp.einsum("tkh,tk->th", out.reshape(T, k, -1), weights)  # [P, H] -> [T, H]


def _slotted_where_it_runs(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array,
                           platform: Platform) -> jax.Array:
    """`_slotted` where the program is lowered for a GPU and the kernel takes the stacks (bf16, tileable), else
    `_gathered_in_place`. For one device: XLA does not partition a Mosaic GPU call, so on a mesh that splits the
    experts it would gather the stacks first (as for "grouped")."""
    if x.dtype == jnp.bfloat16 and all(takes(w.shape, w.dtype) for w in p["experts"].values()):
        slotted = functools.partial(_slotted, platform=platform)
        return on_gpu(platform, slotted, _gathered_in_place, p, x, weights, experts)
    return _gathered_in_place(p, x, weights, experts)


def _grouped_matmul(rows: jax.Array, stack: jax.Array, sizes: jax.Array, kernel: bool, platform: Platform
                    ) -> jax.Array:
    """`rows [M, in] @ stack[e].T` for each expert e's run of `sizes[e]` consecutive rows: `[M, out]`, rows' dtype.

    `stack [E, out, in]` is contracted on its last dim in place (no transposed copy of the weights). `kernel`, on a
    GPU with bf16 operands of tileable sizes: JAX's Mosaic GPU grouped matmul, at the platform's tiles
    (`tuning.Tuning.ragged_dot`); else `jax.lax.ragged_dot_general`."""
    E, out, inner = stack.shape

    def xla(rows: jax.Array, stack: jax.Array, sizes: jax.Array) -> jax.Array:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(rows, stack, sizes, dims, precision=precision(rows, stack),
                                          preferred_element_type=rows.dtype)

    def mosaic(rows: jax.Array, stack: jax.Array, sizes: jax.Array) -> jax.Array:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        return ragged_dot_mgpu.ragged_dot(rows, stack, group_sizes=sizes, transpose_rhs=True, **tiles)

    tiles = dataclasses.asdict(platform.tuning.ragged_dot)
    if kernel and rows.dtype == stack.dtype == jnp.bfloat16 and inner % tiles["block_k"] == 0 \
            and out % tiles["block_n"] == 0:
        return on_gpu(platform, mosaic, xla, rows, stack, sizes)  # where the program is lowered for a GPU
    return xla(rows, stack, sizes)


def _grouped(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, kernel: bool,
             platform: Platform) -> jax.Array:
    """The (token, expert) pairs sorted by expert, each expert's weights applied to its run of rows: `[T, H]`
    float32. Reads each routed expert once however many tokens chose it; computes `T * k` rows, not `T * E`."""
    T, k = experts.shape
    flat = experts.reshape(T * k)  # pair t * k + j: token t's j-th expert
    order = jnp.argsort(flat, stable=True)  # [T * k] the pairs grouped by expert
    sizes = jnp.bincount(flat, length=_num_experts(p)).astype(jnp.int32)  # [E] rows per expert
    rows = jnp.take(x, order // k, axis=0)  # [T * k, H]
    e = p["experts"]
    h = _hidden(e, lambda name: _grouped_matmul(rows, e[name], sizes, kernel, platform))  # [T * k, I] rows' dtype
    out = _grouped_matmul(h.astype(x.dtype), e["down_proj"], sizes, kernel, platform)  # [T * k, H]
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back in pair order
    return jnp.einsum("tkh,tk->th", out.reshape(T, k, -1).astype(jnp.float32), weights)


def _tiled(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array, tile: int) -> jax.Array:
    """The (token, expert) pairs sorted by expert, each expert's run padded to whole tiles of
    `tile` rows (`tuning.Tuning.moe_tile_rows`), and
    each tile multiplied by its expert's weights, gathered once a tile: a batched matmul over tiles, `[T, H]`
    float32. Reads each routed expert once per tile it fills, never the experts no token chose; every shape static
    (at most `ceil((P + min(E, P) * (tile - 1)) / tile)` tiles for P pairs: each expert with rows wastes
    less than one tile)."""
    T, k = experts.shape
    E, P = _num_experts(p), T * k
    n_tiles = ceil_div(P + min(E, P) * (tile - 1), tile)
    flat = experts.reshape(P)  # pair t * k + j: token t's j-th expert
    order = jnp.argsort(flat, stable=True)  # [P] the pairs grouped by expert
    sizes = jnp.bincount(flat, length=E)  # [E] rows per expert
    tiles = ceil_div(sizes, tile)  # [E] tiles per expert
    tile_end = jnp.cumsum(tiles)  # [E] one past each expert's last tile
    by_expert = flat[order]  # [P] the sorted pairs' experts
    rank = jnp.arange(P) - (jnp.cumsum(sizes) - sizes)[by_expert]  # [P] row within its expert's run
    slot = (tile_end - tiles)[by_expert] * tile + rank  # [P] row within the tiles (distinct)
    pair_at = jnp.full((n_tiles * tile,), P, jnp.int32).at[slot].set(order.astype(jnp.int32), unique_indices=True)
    token_at = jnp.where(pair_at < P, pair_at // k, T)  # [n_tiles * tile] T: a padding row
    rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[token_at].reshape(n_tiles, tile, -1)  # [n, tile, H]
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), E - 1)  # [n]
    e = {name: jnp.take(w, tile_expert, axis=0) for name, w in p["experts"].items()}  # [n, out, in] each
    h = _hidden(e, lambda name: dot("nmh,nih->nmi", rows, e[name]))  # [n, tile, I] float32
    out = dot("nmi,nhi->nmh", h.astype(x.dtype), e["down_proj"])  # [n, tile, H] float32
    pair_slot = jnp.zeros((P,), jnp.int32).at[order].set(slot.astype(jnp.int32), unique_indices=True)  # [P]
    out = out.reshape(n_tiles * tile, -1)[pair_slot].reshape(T, k, -1)  # [T, k, H] back in pair order
    return jnp.einsum("tkh,tk->th", out, weights)


Impl = Literal["auto", "gather", "reduce", "slots", "tiled", "grouped", "ragged_dot"]
IMPLS: tuple[Impl, ...] = ("auto", "gather", "reduce", "slots", "tiled", "grouped", "ragged_dot")


def _num_experts(p: Params) -> int:
    return p["experts"]["down_proj"].shape[0]  # every layout's stacks have it: [E, H, I]


def weighted_experts(p: Params, x: jax.Array, weights: jax.Array, experts: jax.Array,
                     impl: Impl = "auto", platform: Platform | None = None) -> jax.Array:
    """The routed experts' weighted sum for tokens `x [T, H]` routed to `experts [T, k]` with `weights [T, k]`:
    `[T, H]` float32; the stacks under `p["experts"]` gated (`gate_proj` and `up_proj`) or not
    (`up_proj` alone: Nemotron-H's relu^2 experts). impl "auto": for at most
    `tuning.Tuning.moe_gather_max_rows` pairs the device kind's `moe_few_rows` ("gather": copied out,
    `_gathered`; "reduce": read in place, `_gathered_in_place`; "slots": each distinct expert read once in place
    by the Mosaic GPU kernel where it runs, `_slotted`, else "reduce"), tiled beyond; "grouped": JAX's Mosaic GPU
    grouped matmul where it runs, XLA's `ragged_dot` elsewhere; "ragged_dot": XLA's always. `platform`: the device
    facts and tuning that choose (default `platform.process_platform()`)."""
    if impl not in IMPLS:
        raise ValueError(f"moe impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    platform = platform or process_platform()
    if impl == "auto" and experts.size <= platform.tuning.moe_gather_max_rows:
        impl = platform.tuning.moe_few_rows
    if impl == "gather":
        return _gathered(p, x, weights, experts)
    if impl == "reduce":
        return _gathered_in_place(p, x, weights, experts)
    if impl == "slots":
        return _slotted_where_it_runs(p, x, weights, experts, platform)
    if impl in ("auto", "tiled"):
        return _tiled(p, x, weights, experts, platform.tuning.moe_tile_rows)
    # The Mosaic GPU kernel stays opt-in: inside the 35B-A3B prefill program (16384 rows a chunk) its compilation
    # crashed XLA on the H200 (jax 0.11.2, docs/benchmarks.md); standalone it ran.
    return _grouped(p, x, weights, experts, impl == "grouped", platform)


def moe_block(p: Params, c: MoeConfig, x: jax.Array, impl: Impl = "auto", platform: Platform | None = None
              ) -> jax.Array:
    """The sparse MoE block over `x [batch, S, H]`: `[batch, S, H]` in x's dtype (module docstring; `impl`: how the
    routed experts run, and `platform`: what chooses it, `weighted_experts`)."""
    batch, S, H = x.shape
    xt = x.reshape(batch * S, H)  # [T, H]
    with jax.named_scope("router"):  # scopes: names in the HLO metadata, for profiles (benchmarks/gpu_trace.py)
        weights, experts = route(p, c, xt)  # [T, k]
    with jax.named_scope("routed"):
        routed = weighted_experts(p, xt, weights, experts, impl, platform)  # [T, H] float32
    with jax.named_scope("shared"):
        shared = gated_shared_expert(p, xt)  # [T, H] float32
    return (routed + shared).astype(x.dtype).reshape(batch, S, H)


def gated_shared_expert(p: Params, x: jax.Array) -> jax.Array:
    """The shared expert's SwiGLU of tokens `x [T, H]` times its sigmoid gate: `[T, H]` float32."""
    s = p["shared_expert"]
    shared = linear(jax.nn.silu(linear(x, s["gate_proj"])) * linear(x, s["up_proj"]), s["down_proj"])  # [T, H]
    gate = jax.nn.sigmoid(linear(x, p["shared_expert_gate"]).astype(jnp.float32))  # [T, 1]
    return gate * shared.astype(jnp.float32)
