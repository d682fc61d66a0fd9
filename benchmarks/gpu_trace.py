"""Where a compiled step spends its GPU time, from a `jax.profiler` trace read here (no TensorBoard, no xprof).

`traced(run, directory, steps)` calls `run()` (a compiled program of `steps` steps) once under
`jax.profiler.trace(directory, create_perfetto_trace=True)` and reads back the `perfetto_trace.json.gz` that JAX
writes (Chrome trace-event JSON). `summarize` reduces the kernels the GPU ran to: kernels a step, GPU busy time
(the union of the kernels' intervals) against the step's wall time (the rest: launch and host gaps, or waits),
the top kernels by total time, and the time of each model scope (`jax.named_scope` names in the HLO ops'
`op_name` metadata, e.g. `delta_net`, `moe/routed`; `hlo_scopes` maps the compiled module's instructions to them).

The device events (`device_events`) are the complete events on the stream lines ("Stream #...") of the
"/device:..." processes; the profiler's derived lines under those processes ("XLA Ops", "XLA Modules", "Steps")
repeat the kernels' time and are left out. On a CPU the trace holds host events only: nothing is selected.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

# The `jax.named_scope`s of the models (target.qwen3_5, .delta_net, .moe) and jitted functions called inside them.
SCOPES = ("embed", "gated_attention", "delta_net", "mlp", "moe", "final_norm", "lm_head", "commit")
SUBSCOPES = ("inputs", "rule", "out", "router", "routed", "shared")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+) = ")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$")


def read_trace(directory: str | pathlib.Path) -> dict:
    """The newest `perfetto_trace.json.gz` under `directory` (as `jax.profiler.trace` writes it), parsed."""
    files = sorted(pathlib.Path(directory).glob("plugins/profile/*/perfetto_trace.json.gz"),
                   key=lambda f: f.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"{directory}: no plugins/profile/*/perfetto_trace.json.gz (a jax.profiler.trace "
                                "with create_perfetto_trace=True writes one)")
    with gzip.open(files[-1], "rb") as f:
        return json.load(f)


def _names(events: Iterable[dict]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    """Process names by pid and thread names by (pid, tid), from the metadata ('M') events."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e.get("pid"), e.get("tid")] = e.get("args", {}).get("name", "")
    return processes, threads


def device_events(trace: dict) -> list[dict]:
    """The complete ('X') events a GPU ran (kernels, copies): on a "Stream ..." thread of a "/device:..." process."""
    events = trace.get("traceEvents", [])
    processes, threads = _names(events)
    return [e for e in events if e.get("ph") == "X" and processes.get(e.get("pid"), "").startswith("/device:")
            and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream")]


def lines(trace: dict) -> list[str]:
    """Every "process / thread" the trace has (to see what a trace holds when no device event was selected)."""
    processes, threads = _names(trace.get("traceEvents", []))
    return sorted(f"{processes.get(pid, pid)} / {name}" for (pid, _), name in threads.items())


def scope_of(op_name: str) -> str:
    """The model scope of an HLO op's `op_name` (`jit(loop)/while/body/jit(_forward)/delta_net/rule/dot_general` ->
    `delta_net/rule`): the first `SCOPES` name (a `jit(name)` counts as `name`) and the `SUBSCOPES` names right
    after it, joined by "/"; "other" where none is named."""
    parts = [p[4:-1] if p.startswith("jit(") and p.endswith(")") else p for p in op_name.split("/")]
    first = next((i for i, p in enumerate(parts) if p in SCOPES), None)
    if first is None:
        return "other"
    end = first + 1
    while end < len(parts) and parts[end] in SUBSCOPES:
        end += 1
    return "/".join(parts[first:end])


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled HLO module's text (`compiled.as_text()`) -> its `scope_of`, also under the
    name its GPU kernel takes. An instruction without `op_name` metadata (a fusion) takes its called computation's
    root's."""
    op_names: dict[str, str | None] = {}
    callee: dict[str, str] = {}
    roots: dict[str, str] = {}
    computation = ""
    for line in hlo_text.splitlines():
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            header = _HEADER.match(line)
            computation = header.group(1) if header else computation
            continue
        name = instruction.group(2)
        op = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        op_names[name] = op.group(1) if op else None
        if calls:
            callee[name] = calls.group(1)
        if instruction.group(1):
            roots[computation] = name

    def resolve(name: str, depth: int = 0) -> str | None:
        if op_names.get(name) or depth > 8 or name not in callee or callee[name] not in roots:
            return op_names.get(name)
        return resolve(roots[callee[name]], depth + 1)

    resolved = {name: resolve(name) for name in op_names}
    scopes = {name: scope_of(op_name) for name, op_name in resolved.items() if op_name is not None}
    # XLA names a fusion's GPU kernel after the instruction, "." as "_" (`loop_add_fusion.2` -> `loop_add_fusion_2`)
    return {name.replace(".", "_"): scope for name, scope in scopes.items()} | scopes


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one of `events` ran (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(events: list[dict], steps: int, wall_s: float, scopes: dict[str, str], top: int = 15) -> dict:
    """`events` (`device_events`) of a program that ran `steps` steps in `wall_s` seconds, per step: kernel count,
    GPU busy ms (`busy_us`), the span from the first kernel's start to the last one's end, the wall ms, and
    `busy_fraction` (busy / wall: what is not busy is launch and host gaps); the `top` kernels by total time
    (name, count a step, us a step, share of busy, the scope of their HLO ops: `args.hlo_op`, else the kernel's
    name, through `scopes`), and the us a step of each scope."""
    if not events:
        return dict(steps=steps, wall_ms=wall_s * 1e3 / steps, kernels_per_step=0.0, busy_ms=0.0, span_ms=0.0,
                    busy_fraction=0.0, top=[], scopes={})
    busy = busy_us(events)
    span = max(e["ts"] + e.get("dur", 0.0) for e in events) - min(e["ts"] for e in events)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    scope_of_name: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_scope: dict[str, float] = collections.defaultdict(float)
    for e in events:
        duration = e.get("dur", 0.0)
        scope = scopes.get(e.get("args", {}).get("hlo_op", ""), scopes.get(e["name"], "other"))
        by_name[e["name"]].append(duration)
        scope_of_name[e["name"]][scope] += duration
        by_scope[scope] += duration
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return dict(
        steps=steps, wall_ms=wall_s * 1e3 / steps, kernels_per_step=len(events) / steps, busy_ms=busy / 1e3 / steps,
        span_ms=span / 1e3 / steps, busy_fraction=busy / 1e6 / wall_s,
        top=[dict(name=name, per_step=len(d) / steps, us_per_step=sum(d) / steps, share_of_busy=sum(d) / busy,
                  scope=scope_of_name[name].most_common(1)[0][0]) for name, d in ranked],
        scopes={s: us / steps for s, us in sorted(by_scope.items(), key=lambda item: -item[1])})


def traced(run: Callable[[], Any], directory: str | pathlib.Path, steps: int, hlo_text: str) -> tuple[dict, Any]:
    """`run()` (a compiled program of `steps` steps; compiled and warm already) once under the profiler, waited
    on: `(summary, run's result)`, the summary `summarize`'s, its scopes from `hlo_text` (the program's compiled
    HLO), plus `trace_lines` where no device event was found (a CPU; or a trace layout this reader does not know)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # device events are what is read; Python frames and every loaded program's HLO
    options.enable_hlo_proto = False  # (the caller gives the one that matters) only slow the trace down
    with jax.profiler.trace(str(directory), create_perfetto_trace=True, profiler_options=options):
        begin = time.perf_counter()
        result = jax.block_until_ready(run())
        wall = time.perf_counter() - begin
    trace = read_trace(directory)
    events = device_events(trace)
    summary = summarize(events, steps, wall, hlo_scopes(hlo_text))
    return (summary if events else summary | dict(trace_lines=lines(trace))), result


def print_summary(title: str, s: dict) -> None:
    """`summarize`'s figures as text."""
    print(f"{title}: {s['kernels_per_step']:.0f} kernels a step; GPU busy {s['busy_ms']:.3f} ms of "
          f"{s['wall_ms']:.3f} ms wall ({s['busy_fraction']:.0%}), first to last kernel {s['span_ms']:.3f} ms",
          flush=True)
    if "trace_lines" in s:
        print("  no device events; the trace's lines: " + "; ".join(s["trace_lines"][:20]), flush=True)
    for scope, us in s["scopes"].items():
        print(f"  scope {scope}: {us:.1f} us a step", flush=True)
    print("  | kernel | a step | us a step | of busy | scope |\n  |---|---:|---:|---:|---|", flush=True)
    for k in s["top"]:
        print(f"  | {k['name'][:90]} | {k['per_step']:.1f} | {k['us_per_step']:.1f} | {k['share_of_busy']:.1%} | "
              f"{k['scope']} |", flush=True)
