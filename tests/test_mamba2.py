"""The Mamba-2 mixer (`dflash_jax.target.mamba2`) against a float64 NumPy loop over rows written from the equations
(in_proj; the conv as a sum over its K taps with the carried inputs; SiLU; the state update; D skip; the gate and
the group RMS norm; out_proj), not from the JAX code. Errors are relative to the largest output (or state) entry."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.target.mamba2 import (
    Mamba2Dims,
    Mamba2State,
    conv_order,
    empty_state,
    in_proj_order,
    mixer,
    select_state,
)

DIMS = Mamba2Dims(heads=4, head_dim=8, groups=2, state=16, conv_kernel=4, chunk=4, eps=1e-5)
HIDDEN, BATCH = 32, 2
TOL = 2e-6  # relative to the output's (state's) scale; float32 runs measure up to 4e-7 (per test below)

run = jax.jit(mixer, static_argnames=("dims", "keep_states"))


def silu(v):
    return v / (1 + np.exp(-v))


def make_params(rng):
    """Weights at magnitudes where every part matters: dt from 0.05 to about 1 (visible decay; each head's
    softplus(dt_bias) one of 0.05, 0.14, 0.37, 1), |A| from 0.5 to 3, D near 1 (its skip as large as the state's
    output), a conv bias as large as its taps' sum."""
    d_inner, conv_dim, nh = DIMS.d_inner, DIMS.conv_dim, DIMS.heads
    in_proj = rng.standard_normal((2 * d_inner + 2 * DIMS.groups * DIMS.state + nh, HIDDEN)) / np.sqrt(HIDDEN)
    in_proj[-nh:] *= 0.3  # dt's rows: dt = softplus(dt_bias + small)
    p = {"in_proj": {"weight": in_proj},
         "conv1d": {"weight": rng.normal(0, 0.5, (conv_dim, 1, DIMS.conv_kernel)),
                    "bias": rng.normal(0, 0.5, conv_dim)},
         "dt_bias": np.log(np.expm1(np.geomspace(0.05, 1.0, nh))),
         "A_log": np.log(rng.uniform(0.5, 3.0, nh)),
         "D": rng.uniform(0.5, 1.5, nh),
         "norm": {"weight": 1 + 0.2 * rng.standard_normal(d_inner)},
         "out_proj": {"weight": rng.standard_normal((HIDDEN, d_inner)) / np.sqrt(d_inner)}}
    return jax.tree.map(lambda a: a.astype(np.float32), p)


def reference(p, x, conv, ssm, dims=DIMS, *, d_skip=True, gate=True, clamp=True, conv_bias=True, bc_groups=None,
              norm_groups=None):
    """One sequence row by row in float64: `x [S, H]` from the state `conv [conv_dim, K-1]` (the last K-1 conv
    inputs, oldest first), `ssm [nh, hd, N]` -> `(y [S, H], [(conv, ssm)] before row 0 and after each row)`. The
    keywords switch off a part (or use fewer groups) to show that it matters."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    nh, hd, n, g = dims.heads, dims.head_dim, dims.state, dims.groups
    d_inner, conv_dim = nh * hd, dims.conv_dim
    bc_groups, norm_groups = bc_groups or g, norm_groups or g
    conv, ssm = np.array(conv, np.float64), np.array(ssm, np.float64)
    a = -np.exp(p["A_log"])
    ys, states = [], [(conv.copy(), ssm.copy())]
    for row in np.asarray(x, np.float64):
        proj = p["in_proj"]["weight"] @ row
        z, xbc, dt = proj[:d_inner], proj[d_inner:d_inner + conv_dim], proj[d_inner + conv_dim:]
        window = np.concatenate([conv, xbc[:, None]], axis=1)  # [conv_dim, K]: oldest first
        out = sum(p["conv1d"]["weight"][:, 0, k] * window[:, k] for k in range(dims.conv_kernel))
        xbc = silu(out + (p["conv1d"]["bias"] if conv_bias else 0))
        conv = window[:, 1:]
        xs = xbc[:d_inner].reshape(nh, hd)
        b, c = xbc[d_inner:d_inner + g * n].reshape(g, n), xbc[d_inner + g * n:].reshape(g, n)
        dt = np.log1p(np.exp(dt + p["dt_bias"]))
        if clamp:
            dt = np.clip(dt, dims.time_step_min, dims.time_step_max)
        y = np.zeros((nh, hd))
        for h in range(nh):
            group = h // (nh // bc_groups)
            ssm[h] = np.exp(dt[h] * a[h]) * ssm[h] + dt[h] * np.outer(xs[h], b[group])
            y[h] = ssm[h] @ c[group] + (p["D"][h] * xs[h] if d_skip else 0)
        y = y.reshape(d_inner) * (silu(z) if gate else 1)
        y = y.reshape(norm_groups, -1)
        y = (y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + dims.eps)).reshape(d_inner) * p["norm"]["weight"]
        ys.append(p["out_proj"]["weight"] @ y)
        states.append((conv.copy(), ssm.copy()))
    return np.stack(ys), states


def reference_batch(p, x, state, **variation):
    """`reference` over the batch: `(y [batch, S, H], final Mamba2State as float64)`."""
    outs = [reference(p, x[i], state.conv[i], state.ssm[i], **variation) for i in range(x.shape[0])]
    final = Mamba2State(conv=np.stack([o[1][-1][0] for o in outs]), ssm=np.stack([o[1][-1][1] for o in outs]))
    return np.stack([o[0] for o in outs]), final


def error(got, want):
    """Largest absolute difference over the largest entry of `want`."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def state_errors(got, want):
    return max(error(got.conv, want.conv), error(got.ssm, want.ssm))


@pytest.fixture(scope="module")
def params():
    return make_params(np.random.default_rng(0))


@pytest.fixture(scope="module")
def rows():
    """13 rows for each of the batch's 2 sequences, and a random (nonzero) state to start from."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, 13, HIDDEN)).astype(np.float32)
    state = Mamba2State(conv=rng.standard_normal((BATCH, DIMS.conv_dim, DIMS.conv_kernel - 1)).astype(np.float32),
                        ssm=rng.standard_normal((BATCH, DIMS.heads, DIMS.head_dim, DIMS.state)).astype(np.float32))
    return x, state


def all_valid(x):
    return jnp.ones(x.shape[:2], bool)


@pytest.mark.parametrize("length", [1, 3, 8, 13])
def test_matches_the_reference(params, rows, length):
    """One row (one step), 3 (one chunk of 3), 8 (two chunks of 4), 13 (four chunks, the last padded), from a
    random state. Measured errors: 1.1e-7 to 3.4e-7 (outputs), 1.6e-7 to 3.1e-7 (states)."""
    x, state = rows[0][:, :length], rows[1]
    y, final = run(params, DIMS, jnp.asarray(x), jax.tree.map(jnp.asarray, state), all_valid(x))
    want_y, want_final = reference_batch(params, x, state)
    chex.assert_shape(y, (BATCH, length, HIDDEN))
    chex.assert_trees_all_equal_shapes_and_dtypes(final, state)
    assert error(y, want_y) < TOL
    assert state_errors(final, want_final) < TOL


def test_prefill_then_decode(params, rows):
    """From an empty state, 9 rows then 4 carrying the state, and 13 single rows (decode), equal one call of 13
    rows: measured at most 1.2e-7."""
    x, state = jnp.asarray(rows[0]), empty_state(DIMS, BATCH, jnp.float32)
    y, final = run(params, DIMS, x, state, all_valid(x))
    y_a, mid = run(params, DIMS, x[:, :9], state, all_valid(x[:, :9]))
    y_b, two = run(params, DIMS, x[:, 9:], mid, all_valid(x[:, 9:]))
    assert error(jnp.concatenate([y_a, y_b], axis=1), np.asarray(y)) < TOL
    assert state_errors(two, jax.tree.map(np.asarray, final)) < TOL
    steps, s = [], state
    for i in range(13):
        y_i, s = run(params, DIMS, x[:, i:i + 1], s, all_valid(x[:, i:i + 1]))
        steps.append(y_i)
    assert error(jnp.concatenate(steps, axis=1), np.asarray(y)) < TOL
    assert state_errors(s, jax.tree.map(np.asarray, final)) < TOL


def test_ragged_batch(params, rows):
    """Valid prefixes 13 and 6: each sequence's state is its own prefix's (the second's as a 6-row run alone:
    measured 0, the same chunks; the first's as the reference's: 2.9e-7), whatever the rows past the prefix hold
    (1e30: bit for bit the same, outputs finite); an invalid single row leaves the state bit for bit."""
    x, state = rows[0].copy(), jax.tree.map(jnp.asarray, rows[1])
    valid = jnp.asarray(np.arange(13)[None] < np.array([[13], [6]]))
    y, final = run(params, DIMS, jnp.asarray(x), state, valid)
    _, alone = run(params, DIMS, jnp.asarray(x[1:, :6]), jax.tree.map(lambda a: a[1:], state), all_valid(x[1:, :6]))
    assert state_errors(jax.tree.map(lambda a: a[1:], final), jax.tree.map(np.asarray, alone)) < TOL
    want_y, want_final = reference_batch(params, x[:1], jax.tree.map(lambda a: np.asarray(a)[:1], state))
    assert error(y[:1], want_y) < TOL and state_errors(jax.tree.map(lambda a: a[:1], final), want_final) < TOL

    x[1, 6:] = 1e30
    y_huge, final_huge = run(params, DIMS, jnp.asarray(x), state, valid)
    chex.assert_trees_all_equal(final_huge, final)
    chex.assert_trees_all_equal(y_huge[1, :6], y[1, :6])
    chex.assert_tree_all_finite(y_huge)

    _, unchanged = run(params, DIMS, jnp.asarray(x[:, 6:7]), state, jnp.zeros((BATCH, 1), bool))
    chex.assert_trees_all_equal(unchanged, state)


def test_keep_states(params, rows):
    """Every row's state of a 5-row call: `select_state` after kept rows (0..5) equals the reference's state after
    kept rows (measured 1.8e-7); the outputs equal the chunked form's (measured 1.1e-7). With a valid prefix of 3
    rows, the states after rows 3 to 5 are the one after row 3, bit for bit."""
    x, state = rows[0][:, :5], rows[1]
    y, states = run(params, DIMS, jnp.asarray(x), jax.tree.map(jnp.asarray, state), all_valid(x), keep_states=True)
    y_chunked, _ = run(params, DIMS, jnp.asarray(x), jax.tree.map(jnp.asarray, state), all_valid(x))
    chex.assert_shape([states.conv, states.ssm], [(BATCH, 6, DIMS.conv_dim, DIMS.conv_kernel - 1),
                                                  (BATCH, 6, DIMS.heads, DIMS.head_dim, DIMS.state)])
    assert error(y, np.asarray(y_chunked)) < TOL
    paths = [reference(params, x[i], state.conv[i], state.ssm[i])[1] for i in range(BATCH)]
    for k in range(6):
        kept = np.array([k, 5 - k])
        want = Mamba2State(conv=np.stack([paths[i][kept[i]][0] for i in range(BATCH)]),
                           ssm=np.stack([paths[i][kept[i]][1] for i in range(BATCH)]))
        assert state_errors(select_state(states, jnp.asarray(kept)), want) < TOL

    valid = jnp.asarray(np.arange(5)[None] < np.array([[5], [3]]))
    _, ragged = run(params, DIMS, jnp.asarray(x), jax.tree.map(jnp.asarray, state), valid, keep_states=True)
    up_to_3 = [jax.tree.map(lambda a: np.asarray(a[1, :4]), st) for st in (ragged, states)]  # the second sequence's
    assert state_errors(*up_to_3) < TOL
    after_3 = select_state(ragged, jnp.asarray([5, 3]))
    for k in (4, 5):
        chex.assert_trees_all_equal(select_state(ragged, jnp.asarray([5, k])), after_3)


def test_each_part_matters(params, rows):
    """With a time_step_max (0.3) that clamps about half of the dt: the mixer matches the full reference (measured
    2e-7) and each variation of it (no D, no gate, no clamp, no conv bias, all heads reading group 0's B and C,
    one norm group over all channels) is far from it (measured 0.44 to 1.7)."""
    dims = DIMS._replace(time_step_max=0.3)
    x, state = rows[0][:, :8], rows[1]
    y, _ = run(params, dims, jnp.asarray(x), jax.tree.map(jnp.asarray, state), all_valid(x))
    assert error(y, reference_batch(params, x, state, dims=dims)[0]) < TOL
    for variation in [{"d_skip": False}, {"gate": False}, {"clamp": False}, {"conv_bias": False}, {"bc_groups": 1},
                      {"norm_groups": 1}]:
        assert error(y, reference_batch(params, x, state, dims=dims, **variation)[0]) > 0.1, variation


def test_bfloat16(params, rows):
    """bf16 weights, inputs and conv state (the SSD still in float32) against the float32 run over 13 rows:
    measured 1.9e-2 of the output's scale (1.1e-2 of it from rounding the weights and inputs alone), 4e-3 of the
    state's."""
    x, state = jnp.asarray(rows[0]), jax.tree.map(jnp.asarray, rows[1])
    y, final = run(params, DIMS, x, state, all_valid(x))
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    state16 = dataclasses.replace(state, conv=state.conv.astype(jnp.bfloat16))
    y16, final16 = run(bf16, DIMS, x.astype(jnp.bfloat16), state16, all_valid(x))
    assert y16.dtype == jnp.bfloat16 and final16.conv.dtype == jnp.bfloat16 and final16.ssm.dtype == jnp.float32
    assert error(y16, np.asarray(y)) < 4e-2
    assert state_errors(final16, jax.tree.map(np.asarray, final)) < 1e-2


@pytest.mark.parametrize("shards", [2, 4])
def test_the_sharded_row_order_is_the_same_mixer(params, rows, shards):
    """`in_proj` and the conv (weight, bias, state) with their rows in the order of `shards` devices (each shard
    `[z_d | x_d | B_d | C_d | dt_d]`; 4 shards: more than the 2 groups) run as one product and one conv: the
    checkpoint order's outputs and SSM states (measured 0 for 2 shards, 5.4e-7 for 4: XLA's sums vectorised
    otherwise), the conv states in the sharded order. One shard's order is the identity, each order a permutation."""
    dims = DIMS._replace(shards=shards)
    proj, conv = in_proj_order(dims), conv_order(dims)
    np.testing.assert_array_equal(in_proj_order(DIMS), np.arange(len(proj)))
    np.testing.assert_array_equal(np.sort(proj), np.arange(len(proj)))
    np.testing.assert_array_equal(np.sort(conv), np.arange(DIMS.conv_dim))
    sharded = {**params, "in_proj": {"weight": params["in_proj"]["weight"][proj]},
               "conv1d": {key: w[conv] for key, w in params["conv1d"].items()}}
    x, state = jnp.asarray(rows[0][:, :8]), jax.tree.map(jnp.asarray, rows[1])
    want_y, want = run(params, DIMS, x, state, all_valid(x), keep_states=True)
    y, got = run(sharded, dims, x, dataclasses.replace(state, conv=state.conv[:, conv]), all_valid(x),
                 keep_states=True)
    chex.assert_trees_all_close(y, want_y, rtol=0, atol=1e-6)
    chex.assert_trees_all_close(got.ssm, want.ssm, rtol=0, atol=1e-6)
    chex.assert_trees_all_close(got.conv, want.conv[:, :, conv], rtol=0, atol=1e-6)
