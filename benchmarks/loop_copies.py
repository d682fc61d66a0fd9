"""Copies of cache-sized buffers in the compiled decode programs: what a decode step moves besides its work.

XLA inserts a `copy` where it cannot update a buffer in place (a loop-carried cache read by an instruction it
cannot order before the in-place write; a buffer that two branches of a conditional both update; ...): a copy of
a cache in a loop reads and writes the whole cache every time the loop's body runs. This script compiles, without
running them, the decode programs of `greedy_generate` and of `speculative_generate` at the fixed draft length
and under the adaptive policy for one shape, and counts in each the copies (outside the entry computation) of
buffers shaped like a layer of the target's KV cache or of the drafter's context cache, with the computation
each is in (`hlo_copies`). Greedy decoding's count is the floor: a copy the speculative programs add to it costs
that cache's bytes per step.

Target: Qwen3-8B shapes with `--layers` layers (copies come per layer; fewer layers compile sooner), the 16-draft
DSpark drafter of `spec_decode.py`, abstract weights (nothing is allocated), batch `--batch`, a prompt of
`--prompt-len` tokens and `--max-new` new ones (the caches' size).

    python3 benchmarks/loop_copies.py --json copies.json     # on the device: the programs it compiles for
    python benchmarks/loop_copies.py --small                 # tiny shapes on a CPU (tests run it)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])  # benchmarks/: share spec_decode's shapes and drafters
from spec_decode import QWEN3_8B, SMALL, drafter_configs  # noqa: E402
from timing import write_rows  # noqa: E402

from dflash_jax import draft_policy, generate  # noqa: E402
from dflash_jax._shapes import round_up  # noqa: E402
from dflash_jax.bookkeeping import stop_array  # noqa: E402
from dflash_jax.config import parse_config  # noqa: E402
from dflash_jax.drafting import init_cache  # noqa: E402
from dflash_jax.model import AttentionOptions  # noqa: E402
from dflash_jax.plain import plain_decode, plain_prefill  # noqa: E402
from dflash_jax.sampling import sampling_controls  # noqa: E402
from dflash_jax.testing import random_drafter, random_qwen3  # noqa: E402

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(.*?(?:calls=%([\w.-]+))?")


def hlo_copies(text: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Counter]:
    """The copies in compiled HLO `text` of buffers of each named shape, outside the entry computation (which copies
    only the program's inputs): per name, how many in each computation. A copy is a `copy` / `copy-start`
    instruction, or a fusion of one (`calls=` a computation named for a copy, as XLA:GPU wraps them); copies inside
    a fusion's own computation are part of its kernel, not counted."""
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.-]+)", text))
    by_dims = {tuple(dims): name for name, dims in shapes.items()}
    found: dict[str, Counter] = {name: Counter() for name in shapes}
    computation, entry = None, False
    for line in text.splitlines():
        if (header := _COMPUTATION.match(line)) and not line.startswith(" "):
            computation, entry = header.group(1), line.startswith("ENTRY")
            continue
        match = _INSTRUCTION.match(line)
        if match is None or entry or computation in fused:
            continue
        dims, opcode, called = match.groups()
        copy = opcode in ("copy", "copy-start") or (opcode == "fusion" and "copy" in (called or ""))
        name = by_dims.get(tuple(int(d) for d in dims.split(",") if d))
        if copy and name is not None:
            found[name][computation] += 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-new", type=int, default=384)
    parser.add_argument("--programs", nargs="+", default=["greedy", "fixed", "adaptive"])
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = SMALL if args.small else {**QWEN3_8B, "num_hidden_layers": args.layers}
    raw = drafter_configs(config, args.small)["dspark"]

    def models():
        target = random_qwen3(config, seed=0)
        return target, random_drafter(parse_config(raw), seed=1).attach(embed=target.embed, lm_head=target.lm_head)

    target, drafter = jax.eval_shape(models)
    K = drafter.config.num_draft_tokens
    prompt = round_up(args.prompt_len, generate.PROMPT_BUCKET)
    budget = round_up(args.max_new, generate.BUDGET_BUCKET)
    capacity = round_up(prompt + budget + K + 1, generate.CACHE_BUCKET)
    tokens = jax.ShapeDtypeStruct((args.batch, prompt), jnp.int32)
    lengths = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    caches = jax.eval_shape(lambda: (target.init_cache(args.batch, capacity),
                                     init_cache(drafter, args.batch, capacity)))
    shapes = {"target KV": caches[0].k[0].shape, "drafter context": caches[1].keys[0].shape}
    warp, stop, key = sampling_controls("loop_copies", 0.0, None, None, None), stop_array(()), \
        jax.random.key(0)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; batch {args.batch}, caches of {capacity} positions; "
          f"a layer's target KV {shapes['target KV']}, drafter context {shapes['drafter context']}", flush=True)
    print("| program | buffer | copies | where (computation: copies) |\n|---|---|---:|---|", flush=True)

    greedy = jax.eval_shape(lambda: plain_prefill(
        target, caches[0], tokens, lengths, stop, scalar, warp, key, capacity=budget, prefill_chunk=2048,
        sampling=False))
    speculative = jax.eval_shape(lambda: generate._spec_prefill(
        target, drafter, *caches, tokens, lengths, stop, warp, key, scalar, capacity=budget, sampling=False,
        attention=AttentionOptions(), prefill_chunk=2048))

    def lowered(mode: str):
        if mode == "greedy":
            return plain_decode.lower(target, greedy, stop, warp, sampling=False)
        policy, settings, _ = draft_policy.resolve_draft_length(mode, K)
        seconds = jax.ShapeDtypeStruct((len(policy.lengths),), jnp.float32)
        return generate._spec_decode.lower(
            target, drafter, speculative, stop, warp, jax.ShapeDtypeStruct((), jnp.float32), scalar, seconds,
            scalar, scalar, settings, sampling=False, attention=AttentionOptions(), policy=policy)

    rows = []
    for mode in args.programs:
        for buffer, where in hlo_copies(lowered(mode).compile().as_text(), shapes).items():
            rows.append(dict(program=mode, buffer=buffer, copies=sum(where.values()), where=dict(where)))
            print(f"| {mode} | {buffer} | {sum(where.values())} | "
                  f"{', '.join(f'{c}: {n}' for c, n in where.items())} |", flush=True)
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
