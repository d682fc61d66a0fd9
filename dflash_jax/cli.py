"""`dflash-jax`: inspect, load, convert and demo drafter checkpoints, and generate with them, from the shell.

Every PATH is a checkpoint directory or a Hugging Face hub id (`--revision`, `--cache-dir`; `HF_HOME`,
`HF_HUB_OFFLINE` and `HF_TOKEN` as for every hub library). Bad input of any kind (a broken checkpoint, an
unknown hub id, an argument out of range) is reported as one `error: ...` line on stderr with exit status 2,
never a traceback. The program (`dflash-jax`, `python -m dflash_jax`) keeps JAX's compiled programs in JAX's
persistent compilation cache, so a second run of the same shapes skips compiling: see `compile_cache`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from ._cluster import coordinator_address, digest
from .compile_cache import enable_compile_cache

if TYPE_CHECKING:
    from .errors import CheckpointError

__all__ = ["main", "run", "parser"]

# Exit statuses: 0 fine, 1 `inspect` found missing or malformed tensors, 2 bad input (argparse's own too).
BAD_INPUT = 2
SIGPIPE_EXIT = 128 + 13  # stdout's reader went away: the status a shell shows for a process SIGPIPE ended
INT32_MAX = 2**31 - 1


def run() -> NoReturn:
    """The program: `main(sys.argv[1:])` with JAX's persistent compilation cache on."""
    sys.exit(main(compilation_cache=True))


def main(argv: list[str] | None = None, *, compilation_cache: bool = False) -> int:
    """Parse `argv` (default `sys.argv[1:]`), run the verb, return the exit status. Process-wide settings
    (`compilation_cache`: `compile_cache.enable_compile_cache`) are `run`'s, so that a caller embedding the CLI
    keeps its own.

    JAX is imported only once the arguments have parsed: `--help` and argument errors answer at once. A reader
    that goes away (`dflash-jax inspect --json x | head -1`) ends the program quietly, with the status of a
    process killed by SIGPIPE (141), as Unix tools end."""
    for stream in (sys.stdout, sys.stderr):  # a name the terminal's encoding lacks is escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = parser().parse_args(argv)
    from .errors import CheckpointError, ConfigError

    try:
        if compilation_cache:
            enable_compile_cache()
        status = args.run(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        # stdout's reader is gone: nothing more can be shown; point stdout at /dev/null so that the interpreter's
        # final flush does not report the pipe again (the Python documentation's recipe, `signal` module)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except (ConfigError, CheckpointError, ValueError, OSError) as e:  # OSError: unreadable or unwritable paths
        print(f"error: {shown(str(e))}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def parser() -> argparse.ArgumentParser:
    """The `dflash-jax` argument parser: its verbs, their flags and help (docs/cli.md)."""
    p = argparse.ArgumentParser(prog="dflash-jax", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dflash-jax {__version__}")
    verbs = p.add_subparsers(dest="verb", required=True)

    v = verbs.add_parser("inspect",
                         help="family, resolved config and tensor table of a drafter or target checkpoint "
                              "(reads headers only)")
    v.add_argument("path", help="checkpoint directory or hub id")
    v.add_argument("--json", action="store_true", help="one JSON object on stdout, for scripts")
    hub_options(v)
    v.set_defaults(run=inspect)

    v = verbs.add_parser("load", help="load a checkpoint for real and report time, bytes/s and memory")
    v.add_argument("path", help="checkpoint directory or hub id")
    v.add_argument("--devices", type=positive_int, default=None,
                   help="replicate over the first N local devices (default: all)")
    v.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    v.add_argument("--weights", default="auto", choices=["auto", "dequantized", "packed", "fp8"],
                   help="the form of NVFP4 / FP8 linear weights: dequantized to --dtype, kept packed, NVFP4 codes "
                        "as FP8 bytes, or auto (default): the device's fastest for --batch")
    v.add_argument("--batch", type=positive_int, default=None,
                   help="sequences a step, for --weights auto (default 1)")
    hub_options(v)
    v.set_defaults(run=load)

    v = verbs.add_parser("demo", help="write a small drafter of each family, load it onto all local devices")
    v.add_argument("--keep", default=None,
                   help="write the demo checkpoints here (default: a temporary directory, removed)")
    v.set_defaults(run=demo)

    v = verbs.add_parser("convert-nvfp4", help="quantize a BF16 drafter's linear weights to NVFP4 (ModelOpt layout)")
    v.add_argument("source", help="checkpoint directory or hub id")
    v.add_argument("destination", help="directory to write (new or empty, unless --overwrite)")
    v.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint files already in DESTINATION (other files stay)")
    hub_options(v)
    v.set_defaults(run=convert_nvfp4)

    v = verbs.add_parser("generate", help="speculative decoding: a target, a drafter, prompt ids")
    v.add_argument("target", help="target checkpoint directory or hub id (Qwen3, Llama 3, Qwen3.5 / 3.6, Nemotron-H)")
    v.add_argument("drafter", help="drafter checkpoint directory or hub id")
    v.add_argument("--prompt-ids", required=True, type=token_ids, help="comma-separated token ids, e.g. 1,2,3")
    v.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="at most this many new tokens; prompt + new tokens must fit the models' "
                        "max_position_embeddings")
    sampling = v.add_argument_group("sampling (lossless: the output follows the target's distribution under them)")
    sampling.add_argument("--temperature", type=temperature, default=0.0, help="0: greedy (default); > 0: sampled")
    sampling.add_argument("--top-k", type=non_negative_int, default=None,
                          help="sample from the K most likely tokens (0: all)")
    sampling.add_argument("--top-p", type=fraction(0.0, False), default=None,
                          help="sample from the smallest set of most likely tokens whose probability reaches P, in "
                               "(0, 1]")
    sampling.add_argument("--min-p", type=fraction(0.0, True), default=None,
                          help="drop tokens less likely than P times the most likely one, P in [0, 1]")
    sampling.add_argument("--seed", type=seed, default=0, help="sampling seed, any integer of at most 64 bits")
    v.add_argument("--stop-token-ids", type=token_ids, default=None,
                   help="comma-separated (default: the target's eos ids, from generation_config.json, else "
                        "config.json)")
    v.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    v.add_argument("--target-revision", default=None, help="hub revision (branch, tag or commit) of the target")
    v.add_argument("--drafter-revision", default=None, help="hub revision of the drafter")
    v.add_argument("--cache-dir", default=None, help="hub cache directory (default: huggingface_hub's, under HF_HOME)")
    v.add_argument("--tensor-parallel", type=positive_int, default=None, metavar="N",
                   help="split the target over N devices (a (1, N) mesh over (\"data\", \"model\")), the drafter "
                        "replicated on them; with --distributed N / P of each of the P processes' devices; default: "
                        "one device, or with --distributed every device of every process")
    v.add_argument("--confidence-threshold", type=non_negative_float, default=0.0, metavar="C",
                   help="DSpark drafters with a confidence head: verify drafts only up to the first whose "
                        "predicted acceptance is below C (default 0: every draft)")
    v.add_argument("--draft-length", choices=("adaptive", "fixed"), default=None,
                   help="adaptive: per step, verify as many drafts as make the most progress per second for the "
                        "sequences the batch waits for (one prompt: the most expected tokens per second), none "
                        "included (dflash_jax.Adaptive, step costs measured on the first steps); fixed: every draft, "
                        "every step; default: adaptive at temperature 0, fixed above it (a seed then reproduces its "
                        "tokens)")
    hosts = v.add_argument_group(
        "across processes (jax.distributed: every process runs the same command, process 0 prints the output)")
    hosts.add_argument("--distributed", action="store_true",
                       help="join a jax.distributed cluster before loading: jax.distributed.initialize(), which "
                            "finds the coordinator, the process count and this process's id on SLURM, Open MPI and "
                            "Kubernetes/Cloud TPU, else from the three flags below (any of them implies --distributed)")
    hosts.add_argument("--coordinator", type=coordinator_address, default=None, metavar="HOST:PORT",
                       help="process 0's address, where its coordinator listens (on that address alone) and the "
                            "others connect; an IPv6 host in brackets (default: $JAX_COORDINATOR_ADDRESS or the "
                            "cluster's)")
    hosts.add_argument("--coordinator-timeout", type=positive_int, default=60, metavar="SECONDS",
                       help="how long to wait for the coordinator and the other processes to join, and to shut "
                            "down, before giving up with an error (default: 60)")
    hosts.add_argument("--num-processes", type=positive_int, default=None, metavar="P")
    hosts.add_argument("--process-id", type=non_negative_int, default=None, metavar="I")
    rule = v.add_argument_group("the drafter's attention rule (default: the config's; docs/references.md)")
    rule.add_argument("--attention-rule", choices=sorted(ATTENTION_RULES), default="config",
                      help="config: as the config states (sliding layers causal and windowed); zlab: every layer "
                           "bidirectional, windows ignored (z-lab's transformers model); vllm-v1: one non-causal "
                           "flag for every layer, windows kept")
    rule.add_argument("--draft-window", type=positive_int, default=None,
                      help="opt-in: full layers see only the last N positions (changes acceptance, not output)")
    rule.add_argument("--draft-sinks", type=non_negative_int, default=0,
                      help="with --draft-window: the first N positions stay visible too")
    v.set_defaults(run=generate)
    return p


DTYPES = ["bfloat16", "float16", "float32"]


def hub_options(verb: argparse.ArgumentParser) -> None:
    verb.add_argument("--revision", default=None, help="hub revision: a branch, tag or commit (for a hub id)")
    verb.add_argument("--cache-dir", default=None,
                      help="hub cache directory (default: huggingface_hub's, under HF_HOME)")


# `AttentionOptions(causal, sliding_window)` of each named rule (docs/references.md gives the sources)
ATTENTION_RULES: dict[str, tuple[bool | None, bool]] = {
    "config": (None, True),
    "zlab": (False, False),
    "vllm-v1": (False, True),
}


INT64_MAX = 2**63 - 1  # what a C long holds: a larger count or size is no one's intent and overflows JAX's ints


def _integer(text: str, minimum: int, says: str, maximum: int = INT64_MAX) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} {says}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"{value} is larger than {maximum}")
    return value


def seed(text: str) -> int:
    """A seed of at most 64 bits (`_arguments.check_seed`: signed or unsigned)."""
    return _integer(text, -(2**63), "is below -2**63", 2**64 - 1)


def positive_int(text: str) -> int:
    return _integer(text, 1, "is not a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "is negative")


def token_ids(text: str) -> list[int]:
    """`1,2,3` (spaces allowed) -> [1, 2, 3]: at least one id, each a non-negative integer."""
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("no token ids; expected comma-separated integers such as 1,2,3")
    if not all(t.isdigit() and t.isascii() for t in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated non-negative integers such as 1,2,3")
    ids = [int(t) for t in parts]
    too_large = [i for i in ids if i > INT32_MAX]
    if too_large:
        raise argparse.ArgumentTypeError(f"token id {too_large[0]} is larger than {INT32_MAX} (ids are int32)")
    return ids


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def temperature(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a finite temperature >= 0")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0")
    return value


def fraction(low: float, low_included: bool):
    """A parser of numbers in `[low, 1]` or `(low, 1]`."""
    shown_range = f"{'[' if low_included else '('}{low:g}, 1]"

    def parse(text: str) -> float:
        value = _number(text)
        if not (low <= value <= 1 if low_included else low < value <= 1):
            raise argparse.ArgumentTypeError(f"{text}: expected a number in {shown_range}")
        return value

    return parse


def shown(text: str) -> str:
    """`text` with every character a terminal would not print as itself (controls, escapes, lone surrogates)
    written as a Python escape, so that names from a hostile file neither crash the output nor drive the
    terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


def local(path: str, args: argparse.Namespace, revision: str | None = None) -> str:
    """A checkpoint directory for a path or hub id (downloaded into the hub cache when needed)."""
    from .hub import resolve

    return resolve(path, revision=revision or getattr(args, "revision", None), cache_dir=args.cache_dir)


def inspect(args: argparse.Namespace) -> int:
    import msgspec

    from ._config_file import read_config_json
    from .config import parse_config
    from .plan import open_checked, tensor_report, unexpected_tensors
    from .target.config import is_drafter_config
    from .target.loading import named_family

    path = local(args.path, args)
    file, raw = read_config_json(path, "a drafter or target checkpoint directory")
    if not is_drafter_config(raw) and named_family(raw) is not None:
        return inspect_target(args, path, file, raw)
    # (tensor name, CheckpointError): every planned tensor that does not pass
    failures: list[tuple[str, CheckpointError]] = []
    with open_checked(path, parse_config(raw, source=file), problems=failures) as (ckpt, config, plan,
                                                                                   checked_packed):
        packed = [t.name for t in plan if t.name in checked_packed]  # in plan order
        report = tensor_report(ckpt, failures)
        tensors, files, missing, malformed = (report[k] for k in ("tensors", "files", "missing", "malformed"))
        extra = unexpected_tensors(plan, ckpt)
    B, n = config.effective_block_size, config.num_draft_tokens
    own = {part for part in ("embed_tokens", "lm_head") if any(t.path[0] == part for t in plan)}
    resolved: dict[str, Any] = {
        "family": config.family, "effective_block_size": B,
        "num_draft_tokens": n, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.checked_target_layer_ids), "rope_theta": config.rope_theta,
        "rope_type": config.rope_type, "attention": _attention_summary(config),
        "attention_sinks": config.attention_sinks,
        "draft_rows": f"{B - n}..{B - 1}" + (" (row 0: the anchor, apart)" if B > n else " (the anchor's row drafts)"),
        "embedding": "own (embed_tokens)" if "embed_tokens" in own else "the target's",
        "lm_head": "own" if "lm_head" in own else "the target's",
    }
    if packed:
        resolved["weights_auto"] = auto_forms()
    problems = [message for _, message in missing + malformed]
    if args.json:
        print(json.dumps({
            "path": args.path, "directory": path, "family": config.family, "nvfp4": bool(packed),
            "resolved": resolved, "config": msgspec.to_builtins(config), "tensors": tensors, "files": files,
            "total_bytes": sum(t["bytes"] for t in tensors), "nvfp4_tensors": packed,
            "missing": [name for name, _ in missing], "malformed": [m for _, m in malformed], "unexpected": extra,
        }, indent=2))
        return 1 if problems else 0
    c = config
    print(shown(f"{args.path}: {c.family} drafter" + (f" ({path})" if path != args.path else "")
                + (f", NVFP4: {len(packed)} packed linear weights" if packed else "")))
    rows = {**resolved, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "heads (q/kv x dim)": f"{c.num_attention_heads}/{c.num_key_value_heads} x {c.head_dim}",
            "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    rows.pop("family")
    for key, value in rows.items():
        print(f"  {key:<22} {value}")
    print_tensors(tensors, files, problems)
    print(shown(f"  unexpected: {len(extra)}" + "".join(f"\n    {n}" for n in extra)))
    return 1 if problems else 0


def auto_forms() -> str:
    """The forms `load_drafter(weights="auto")` places quantized weights in on this process's devices (bfloat16),
    by batch, and whose rules they are: `inspect`'s `weights_auto`."""
    import jax.numpy as jnp

    from .placement import auto_rules, describe_rules
    from .platform import process_platform

    rules, whose = auto_rules(process_platform(), jnp.bfloat16)
    return f"{describe_rules(rules)} ({whose})"


def inspect_target(args: argparse.Namespace, path: str, file: str, raw: dict[str, Any]) -> int:
    """`inspect` of a target checkpoint (`target.inspection`): the same table, the target's own summary."""
    from .target.inspection import inspect_target as describe

    found = describe(path, file, raw)
    problems = [message for _, message in found["missing"] + found["malformed"]]
    if args.json:
        print(json.dumps({"path": args.path, "directory": path, "kind": "target", **found,
                          "total_bytes": sum(t["bytes"] for t in found["tensors"]),
                          "missing": [name for name, _ in found["missing"]],
                          "malformed": [m for _, m in found["malformed"]]}, indent=2))
        return 1 if problems else 0
    print(shown(f"{args.path}: {found['family']} target" + (f" ({path})" if path != args.path else "")))
    for key, value in found["resolved"].items():
        print(shown(f"  {key:<24} {value}"))
    print_tensors(found["tensors"], found["files"], problems)
    return 1 if problems else 0


def print_tensors(tensors: list[dict[str, Any]], files: list[str], problems: list[str]) -> None:
    """`inspect`'s tensor table, its totals and the planned tensors that would not load."""
    names = {t["name"]: shown(t["name"]) for t in tensors}
    width = max((len(n) for n in names.values()), default=6)
    print(f"\n  {'tensor':<{width}}  {'dtype':<8} {'shape':<18} {'bytes':>12}")
    for t in tensors:
        print(f"  {names[t['name']]:<{width}}  {t['dtype']:<8} {str(t['shape']):<18} {t['bytes']:>12,}")
    print(f"\n  {len(tensors)} tensors, {sum(t['bytes'] for t in tensors):,} bytes in {len(files)} file(s)")
    print(shown(f"  missing or malformed: {len(problems)}" + "".join(f"\n    {p}" for p in problems)))


def _attention_summary(config) -> str:
    """The layers' attention rules in words, runs of equal layers grouped: "layers 0-5: causal, window 1024"."""
    from .model import attention_rules

    words = [("causal" if r.causal else "bidirectional") + (f", window {r.window}" if r.window else "")
             for r in attention_rules(config)]
    runs: list[tuple[int, int, str]] = []
    for i, w in enumerate(words):
        runs = runs[:-1] + [(runs[-1][0], i, w)] if runs and runs[-1][2] == w else runs + [(i, i, w)]
    return "; ".join(f"layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {w}" for a, b, w in runs)


def load(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from .loader import load_drafter
    from .safetensors import Checkpoint

    available = jax.local_devices()
    if args.devices and args.devices > len(available):
        raise ValueError(f"--devices {args.devices}: this process has {len(available)} local device(s)")
    devices = available[: args.devices or len(available)]
    mesh = jax.sharding.Mesh(devices, ("replica",))
    path = local(args.path, args)
    with Checkpoint(path) as ckpt:
        nbytes = sum(ckpt[n].nbytes for n in ckpt)
    start = time.perf_counter()
    drafter = load_drafter(path, mesh=mesh, dtype=jnp.dtype(args.dtype), progress=None, weights=args.weights,
                           batch=args.batch)
    jax.block_until_ready(drafter.params)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    leaves = jax.tree.leaves(drafter.params)
    print(shown(f"{args.path}: {drafter.config.family}, {len(leaves)} tensors, {nbytes / 1e6:.1f} MB on disk"))
    print(f"loaded onto {len(devices)} x {devices[0].platform} in {seconds:.3f} s "
          f"({nbytes / seconds / 1e9:.2f} GB/s), peak host RSS {peak_mb:.0f} MB, "
          f"{drafter.param_bytes / 1e6:.1f} MB of parameters per device"
          + (f", weights {drafter.weights}" if drafter.weights else ""))
    return 0


def demo(args: argparse.Namespace) -> int:
    import jax

    # The package's own log lines (the load summaries) and nothing else: JAX's backend messages stay quiet.
    log = logging.getLogger("dflash_jax")
    handler = _Lines(sys.stdout)
    handler.setFormatter(logging.Formatter("    %(message)s"))
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        mesh = jax.sharding.Mesh(jax.local_devices(), ("replica",))
        print(f"dflash_jax demo: {len(mesh.devices.flat)} local device(s): {jax.local_devices()[0].platform}")
        if args.keep:
            _demo(args.keep, mesh)
            print(f"checkpoints in {args.keep}")
        else:
            with tempfile.TemporaryDirectory(prefix="dflash_jax_demo_") as root:
                _demo(root, mesh)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return 0


class _Lines(logging.StreamHandler):
    """A handler for the program's own output: a closed pipe ends the program (`main`), rather than printing
    logging's traceback and carrying on."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            raise BrokenPipeError  # noqa: B904  (the exception being handled is this one)
        super().handleError(record)


def _demo(root: str, mesh) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .loader import load_drafter
    from .model import draft_logits
    from .testing import write_checkpoint

    rng = np.random.default_rng(0)
    for preset in ("tiny-dflash", "tiny-dflash2", "tiny-dspark"):
        directory = os.path.join(root, preset)
        write_checkpoint(directory, preset, prefix="model." if preset == "tiny-dflash2" else "")
        start = time.perf_counter()
        drafter = load_drafter(directory, mesh=mesh)
        seconds = time.perf_counter() - start
        leaves = jax.tree.leaves(drafter.params)
        nbytes = sum(x.nbytes for x in leaves)
        print(f"  {preset}: {len(leaves)} tensors, {nbytes / 1e3:.0f} kB, replicated on "
              f"{len(leaves[0].sharding.device_set)} device(s), {seconds * 1e3:.0f} ms")
        # One block through the drafter, with random stand-ins for the target's embedding, LM head and features.
        c = drafter.config
        embed, head = (jnp.asarray(rng.standard_normal((c.vocab_size, c.hidden_size)), jnp.bfloat16) for _ in "ab")
        drafter = drafter.attach(embed=embed, lm_head=head)
        S, B = 12, c.effective_block_size
        feats = jnp.asarray(rng.standard_normal((1, S, len(c.checked_target_layer_ids) * c.hidden_size)), jnp.bfloat16)
        block = jnp.asarray([[7] + [c.mask_token_id] * (B - 1)])
        logits = draft_logits(drafter, feats, block, context_positions=jnp.arange(S)[None],
                              block_positions=S + jnp.arange(B)[None])
        drafts = jnp.argmax(logits[0, B - c.num_draft_tokens:], axis=-1)
        print(f"    one block [anchor, mask x {B - 1}] -> logits {list(logits.shape)}, "
              f"{c.num_draft_tokens} drafts {drafts.tolist()}")


def convert_nvfp4(args: argparse.Namespace) -> int:
    from .nvfp4.convert import convert_checkpoint

    written = convert_checkpoint(local(args.source, args), args.destination, overwrite=args.overwrite)
    print(shown(f"{args.destination}: {written} linear weights stored as NVFP4"))
    return 0


def generate(args: argparse.Namespace, decode: Callable[..., Any] | None = None) -> int:
    """The `generate` verb: load the pair, decode with `decode` (`speculative_generate` unless given), print."""
    import jax
    import jax.numpy as jnp

    from ._cluster import check_same_models, join
    from .errors import CheckpointError, ConfigError
    from .generate import speculative_generate
    from .loader import load_drafter
    from .model import AttentionOptions
    from .target.loading import load_target

    causal, sliding_window = ATTENTION_RULES[args.attention_rule]
    attention = AttentionOptions(causal=causal, sliding_window=sliding_window, draft_window=args.draft_window,
                                 draft_sinks=args.draft_sinks)  # refused before anything loads
    dtype = jnp.dtype(args.dtype)
    distributed = args.distributed or any(
        x is not None for x in (args.coordinator, args.num_processes, args.process_id))
    if distributed:
        native_output_to_stderr()
        join(args.coordinator, args.num_processes, args.process_id, args.coordinator_timeout)
        check_same_arguments(args)
    mesh = tensor_parallel_mesh(args.tensor_parallel)
    try:
        target = load_target(args.target, mesh=mesh, dtype=dtype, revision=args.target_revision,
                             cache_dir=args.cache_dir)
        if not distributed:  # across processes: once every process is known to hold the same target
            check_ids(target.config, args)
        drafter = load_drafter(args.drafter, mesh=mesh, dtype=dtype, revision=args.drafter_revision,
                               cache_dir=args.cache_dir)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        if not distributed:
            raise
        check_same_models(None, e)  # raises: the others learn that this process failed, and stop too
    if distributed:
        check_same_models((target.config, drafter.config), None)
        check_ids(target.config, args)
    if args.confidence_threshold and "confidence_head" not in drafter.params:
        raise ValueError(f"--confidence-threshold {args.confidence_threshold}: this {drafter.config.family} drafter "
                         "has no confidence head (DSpark drafters with enable_confidence_head have one)")
    # A progress display on a terminal only: its callback runs inside the compiled loop, and JAX does not store
    # programs with host callbacks in the persistent cache, so without a terminal the loop is cached too.
    shows = jax.process_index() == 0  # every process holds the same tokens: one prints them
    terminal = shows and sys.stderr.isatty()
    bar, report = progress_display(args.max_new_tokens, enabled=terminal)
    with bar:
        result = (decode or speculative_generate)(
            target, drafter, args.prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop_token_ids=args.stop_token_ids,
            confidence_threshold=args.confidence_threshold, progress=report if terminal else None,
            attention=attention, draft_length=args.draft_length,
        )
    if shows:
        print(",".join(map(str, result.tokens[0])))
        plain = f", {result.plain_tokens[0]} from plain steps" if result.plain_tokens[0] else ""
        print(f"{result.num_tokens} tokens{plain}, {len(result.acceptance_lengths[0])} verify steps, mean acceptance "
              f"length {result.mean_acceptance_length:.2f}; prefill {result.prefill_seconds:.3f} s, decode "
              f"{result.decode_seconds:.3f} s ({result.decode_tokens_per_second:.1f} tokens/s, compilation included)",
              file=sys.stderr)
    if distributed:
        jax.distributed.shutdown()  # waits for every process: process 0 serves the others until they are done
    return 0


def native_output_to_stderr() -> None:
    """Send what native libraries write to file descriptor 1 (Gloo's connection lines, between CPU processes) to
    stderr, and `sys.stdout` to the real stdout: stdout carries the program's output alone, for the pipe it feeds."""
    sys.stdout.flush()
    real = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = open(real, "w", encoding=sys.stdout.encoding, errors="backslashreplace")  # noqa: SIM115 (stdout)


# The `generate` flags every process of a --distributed run must be given alike: they decide the computation, which
# the processes run together (the paths, revisions and cache directory may differ between hosts).
SAME_EVERYWHERE = ("prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                   "stop_token_ids", "dtype", "tensor_parallel", "confidence_threshold", "draft_length",
                   "attention_rule", "draft_window", "draft_sinks")


def check_same_arguments(args: argparse.Namespace) -> None:
    """Refuse (ValueError naming the flag) a --distributed run whose processes were given different prompts or
    decoding flags: they would compute one sharded program from different inputs and print tokens no process
    asked for, or hang. Each process contributes `argument_digests` to one small all-gather."""
    from jax.experimental import multihost_utils

    mine = argument_digests(args)
    for process, theirs in enumerate(multihost_utils.process_allgather(mine)):  # [processes, flags, 8]
        for name, a, b in zip(SAME_EVERYWHERE, mine, theirs):
            if (a != b).any():
                raise ValueError(f"--{name.replace('_', '-')} differs between this process and process {process}: "
                                 "every process of a --distributed run must be given the same prompt and decoding "
                                 "flags")


def argument_digests(args: argparse.Namespace):
    """`[flags, 8]` uint8: the digest (`_cluster.digest`) of each `SAME_EVERYWHERE` flag's value."""
    import numpy as np

    return np.stack([digest(repr(getattr(args, name))) for name in SAME_EVERYWHERE])


def tensor_parallel_mesh(size: int | None):
    """The (1, N) ("data", "model") mesh of --tensor-parallel N over N / P devices of each of the P processes
    (N default: one device, or every device when there are several processes); None for one device."""
    import jax

    processes = jax.process_count()
    size = size or (jax.device_count() if processes > 1 else 1)
    if size > jax.device_count():
        raise ValueError(f"--tensor-parallel {size}: there are {jax.device_count()} device(s)")
    if size % processes:
        raise ValueError(f"--tensor-parallel {size}: not a multiple of the {processes} processes (each process "
                         "holds an equal part of the target)")
    if size == 1:
        return None
    per_process = [[d for d in jax.devices() if d.process_index == p][: size // processes] for p in range(processes)]
    return jax.make_mesh((1, size), ("data", "model"), devices=[d for part in per_process for d in part])


def progress_display(total: int, *, enabled: bool) -> tuple[Any, Any]:
    """`(display, report)`: a status line with a spinner, "compiling and prefilling", until the decode loop reports
    its first step through `report(n_out)` (compiling the programs takes seconds to minutes on a first run), then
    a bar of the tokens made. Transient, on stderr; `enabled=False` shows nothing."""
    from rich import progress as rp
    from rich.console import Console

    display = rp.Progress(rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                          rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), transient=True, disable=not enabled,
                          console=Console(stderr=True))
    task = display.add_task("compiling and prefilling", total=total)

    def report(n_out) -> None:
        display.update(task, description="generating", completed=int(n_out.max()))

    return display, report


def check_ids(config, args: argparse.Namespace) -> None:
    """Token ids inside the target's vocabulary (runs longer than the models' positions, which would also
    allocate caches of that length, are refused by `speculative_generate` itself)."""
    from ._arguments import check_token_ids

    for flag, ids in (("--prompt-ids", args.prompt_ids), ("--stop-token-ids", args.stop_token_ids or [])):
        check_token_ids("dflash-jax generate", flag, ids, config.vocab_size)


if __name__ == "__main__":
    run()
