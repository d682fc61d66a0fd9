"""benchmarks/gpu_trace.py, the profile reader of `hybrid_decode.py --profile`: which trace events are GPU work
(on a synthetic trace in the layout of the profiler's GPU traces; a CPU trace has none), the figures it reduces
them to (against hand-computed ones), and the model scopes of a compiled program's HLO ops."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_trace():
    spec = importlib.util.spec_from_file_location("gpu_trace", os.path.join(ROOT, "benchmarks", "gpu_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def kernel(pid, tid, name, ts, dur, hlo_op=None):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
            "args": {} if hlo_op is None else {"hlo_op": hlo_op, "hlo_module": "jit_loop"}}


# Two steps on GPU 0: kernels a (scope delta_net/rule) and b (moe/routed, found by its kernel name: no hlo_op) on
# the compute stream, a copy on another stream overlapping b; the derived "XLA Ops" line repeating a kernel, and
# host events, which are not GPU work.
KERNELS = [kernel(1, 7, "a", 0.0, 10.0, "fusion.1"), kernel(1, 7, "loop_b_fusion_3", 12.0, 20.0),
           kernel(1, 9, "MemcpyD2D", 30.0, 6.0), kernel(1, 7, "a", 50.0, 10.0, "fusion.1"),
           kernel(1, 7, "loop_b_fusion_3", 62.0, 20.0)]
TRACE = {"traceEvents": [
    meta(1, "/device:GPU:0"), meta(1, "Stream #7(Compute)", 7), meta(1, "Stream #9(MemcpyD2D)", 9),
    meta(1, "XLA Ops", 2), meta(2, "/host:CPU"), meta(2, "python", 5), *KERNELS,
    kernel(1, 2, "fusion.1", 0.0, 10.0), kernel(2, 5, "PjitFunction(loop)", -5.0, 100.0), {"ph": "i", "pid": 1}]}


def test_device_events_are_the_stream_lines_of_device_processes(gpu_trace):
    assert gpu_trace.device_events(TRACE) == KERNELS
    assert "/device:GPU:0 / XLA Ops" in gpu_trace.lines(TRACE)


def test_busy_time_is_the_union_of_the_intervals(gpu_trace):
    """[0, 10] + [12, 32] + [30, 36] (overlapping b by 2) + [50, 60] + [62, 82]: 10 + 24 + 10 + 20 = 64 us."""
    assert gpu_trace.busy_us(KERNELS) == pytest.approx(64.0)
    assert gpu_trace.busy_us([kernel(1, 7, "x", 0.0, 10.0), kernel(1, 7, "y", 2.0, 3.0)]) == pytest.approx(10.0)


def test_summarize_per_step(gpu_trace):
    scopes = {"fusion.1": "delta_net/rule", "loop_b_fusion_3": "moe/routed"}
    s = gpu_trace.summarize(gpu_trace.device_events(TRACE), steps=2, wall_s=100e-6, scopes=scopes)
    assert s["kernels_per_step"] == 2.5
    assert s["busy_ms"] == pytest.approx(0.032) and s["wall_ms"] == pytest.approx(0.05)
    assert s["span_ms"] == pytest.approx(0.041) and s["busy_fraction"] == pytest.approx(0.64)
    assert [(k["name"], k["per_step"], k["us_per_step"], k["scope"]) for k in s["top"]] == [
        ("loop_b_fusion_3", 1.0, 20.0, "moe/routed"), ("a", 1.0, 10.0, "delta_net/rule"),
        ("MemcpyD2D", 0.5, 3.0, "other")]
    assert s["scopes"] == {"moe/routed": 20.0, "delta_net/rule": 10.0, "other": 3.0}
    assert gpu_trace.summarize([], 2, 1e-3, scopes)["kernels_per_step"] == 0


@pytest.mark.parametrize("op_name, scope", [
    ("jit(loop)/while/body/closed_call/jit(_forward)/delta_net/rule/bhik,bhkv->bhiv/dot_general", "delta_net/rule"),
    ("jit(loop)/while/body/jit(_forward)/moe/routed/_take/gather", "moe/routed"),
    ("jit(loop)/while/body/jit(commit)/take_along_axis/gather", "commit"),
    ("jit(loop)/while/body/jit(_forward)/add", "other")])
def test_scope_of_an_op_name(gpu_trace, op_name, scope):
    assert gpu_trace.scope_of(op_name) == scope


def test_hlo_scopes_of_a_compiled_program(gpu_trace):
    """A compiled CPU program: the ops of each scope found; a fusion without metadata takes its root's scope."""
    @jax.jit
    def commit(x):
        return x[::-1]

    def loop(x):
        def body(i, x):
            with jax.named_scope("delta_net"), jax.named_scope("rule"):
                x = jnp.sin(x) @ x
            return commit(x)
        return jax.lax.fori_loop(0, 3, body, x)

    scopes = gpu_trace.hlo_scopes(jax.jit(loop).lower(jnp.ones((8, 8))).compile().as_text())
    assert {"delta_net/rule", "commit"} <= set(scopes.values())
    text = """HloModule m
%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %sine.1 = f32[8]{0} sine(%p), metadata={op_name="jit(f)/moe/shared/sin"}
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %loop_sine_fusion = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation
}
"""
    assert gpu_trace.hlo_scopes(text) == {"sine.1": "moe/shared", "sine_1": "moe/shared",
                                          "loop_sine_fusion": "moe/shared"}


def test_a_cpu_trace_is_read_and_has_no_device_events(gpu_trace, tmp_path):
    f = jax.jit(lambda x: x * 2)
    x = jnp.ones(4)
    compiled = f.lower(x).compile()
    compiled(x)
    summary, result = gpu_trace.traced(lambda: compiled(x), tmp_path, 1, compiled.as_text())
    assert float(result[0]) == 2.0 and summary["kernels_per_step"] == 0 and summary["wall_ms"] > 0
    assert any(line.startswith("/host:CPU") for line in summary["trace_lines"])
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        gpu_trace.read_trace(tmp_path / "nothing")
