"""`dflash-jax`: inspect, load, convert and demo drafter checkpoints, and generate with them, from the shell."""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-jax", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("inspect", help="family, resolved config and tensor table of a checkpoint (reads headers only)")
    p.add_argument("path")
    p.set_defaults(run=inspect)
    p = verbs.add_parser("load", help="load a checkpoint for real and report time, bytes/s and memory")
    p.add_argument("path")
    p.add_argument("--devices", type=int, default=None, help="replicate over the first N local devices (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(run=load)
    p = verbs.add_parser("demo", help="write a small drafter of each family, load it onto all local devices")
    p.add_argument("--keep", default=None, help="write the demo checkpoints here instead of a temporary directory")
    p.set_defaults(run=demo)
    p = verbs.add_parser("convert-nvfp4", help="quantize a BF16 drafter's linear weights to NVFP4 (ModelOpt layout)")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(run=convert_nvfp4)
    p = verbs.add_parser("generate", help="speculative decoding: a Qwen3 or Llama target directory, a drafter "
                         "directory, prompt ids")
    p.add_argument("target")
    p.add_argument("drafter")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled, lossless")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token-ids", default=None, help="comma-separated (default: the target's eos_token_id)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(run=generate)
    args = parser.parse_args(argv)
    from .errors import CheckpointError, ConfigError

    try:
        return args.run(args) or 0
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def inspect(args: argparse.Namespace) -> int:
    from .config import load_config
    from .loader import check_tensor, find_prefix, plan_tensors, unexpected_tensors
    from .errors import CheckpointError
    from .safetensors import Checkpoint

    config = load_config(args.path)
    print(f"{args.path}: {config.family} drafter")
    resolved = {
        "effective_block_size": config.effective_block_size, "num_draft_tokens": config.num_draft_tokens,
        "mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
        "rope_theta": config.rope_theta, "rope_type": config.rope_type, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "heads (q/kv x dim)": f"{config.num_attention_heads}/{config.num_key_value_heads} x {config.head_dim}",
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
    }
    for key, value in resolved.items():
        print(f"  {key:<22} {value}")
    with Checkpoint(args.path) as ckpt:
        plan = plan_tensors(config, ckpt.__contains__, find_prefix(ckpt, args.path), args.path)
        problems = []
        for t in plan:
            try:
                check_tensor(t, ckpt, args.path)
            except CheckpointError as e:
                problems.append(str(e))
        width = max(len(n) for n in ckpt)
        print(f"\n  {'tensor':<{width}}  {'dtype':<8} {'shape':<18} {'bytes':>12}")
        for name in sorted(ckpt):
            info = ckpt[name]
            print(f"  {name:<{width}}  {info.dtype:<8} {str(list(info.shape)):<18} {info.nbytes:>12,}")
        total = sum(ckpt[n].nbytes for n in ckpt)
        print(f"\n  {len(ckpt)} tensors, {total:,} bytes in {len(ckpt.files)} file(s)")
        extra = unexpected_tensors(plan, ckpt)
    print(f"  missing or malformed: {len(problems)}" + "".join(f"\n    {p}" for p in problems))
    print(f"  unexpected: {len(extra)}" + "".join(f"\n    {n}" for n in extra))
    return 1 if problems else 0


def load(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from .loader import load_drafter
    from .safetensors import Checkpoint

    devices = jax.local_devices()[: args.devices] if args.devices else jax.local_devices()
    mesh = jax.sharding.Mesh(devices, ("replica",))
    with Checkpoint(args.path) as ckpt:
        nbytes = sum(ckpt[n].nbytes for n in ckpt)
    start = time.perf_counter()
    drafter = load_drafter(args.path, mesh=mesh, dtype=jnp.dtype(args.dtype), progress=None)
    jax.block_until_ready(drafter.params)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    leaves = jax.tree.leaves(drafter.params)
    print(f"{args.path}: {drafter.config.family}, {len(leaves)} tensors, {nbytes / 1e6:.1f} MB on disk")
    print(f"loaded onto {len(devices)} x {devices[0].platform} in {seconds:.3f} s "
          f"({nbytes / seconds / 1e9:.2f} GB/s), peak host RSS {peak_mb:.0f} MB")
    return 0


def demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .loader import load_drafter
    from .model import draft_logits
    from .testing import write_checkpoint

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mesh = jax.sharding.Mesh(jax.local_devices(), ("replica",))
    print(f"dflash_jax demo: {len(mesh.devices.flat)} local device(s): {jax.local_devices()[0].platform}")
    root = args.keep or tempfile.mkdtemp(prefix="dflash_jax_demo_")
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
        feats = jnp.asarray(rng.standard_normal((1, S, len(c.target_layer_ids) * c.hidden_size)), jnp.bfloat16)
        block = jnp.asarray([[7] + [c.mask_token_id] * (B - 1)])
        logits = draft_logits(drafter, feats, block, context_positions=jnp.arange(S)[None],
                              block_positions=S + jnp.arange(B)[None])
        drafts = jnp.argmax(logits[0, B - c.num_draft_tokens:], axis=-1)
        print(f"    one block [anchor, mask x {B - 1}] -> logits {list(logits.shape)}, "
              f"{c.num_draft_tokens} drafts {drafts.tolist()}")
    print(f"checkpoints in {root}")
    return 0


def convert_nvfp4(args: argparse.Namespace) -> int:
    from .nvfp4.convert import convert_checkpoint

    written = convert_checkpoint(args.source, args.destination)
    print(f"{args.destination}: {written} linear weights stored as NVFP4")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    from rich import progress as rp

    from .generate import speculative_generate
    from .loader import load_drafter
    from .target import load_target

    def ids(text: str) -> list[int]:
        return [int(t) for t in text.replace(" ", "").split(",") if t]

    target = load_target(args.target, dtype=jnp.dtype(args.dtype))
    drafter = load_drafter(args.drafter, dtype=jnp.dtype(args.dtype))
    stop = ids(args.stop_token_ids) if args.stop_token_ids is not None else list(target.config.eos_token_ids)
    bar = rp.Progress(rp.TextColumn("generating"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                      transient=True, disable=not sys.stderr.isatty())
    task = bar.add_task("generate", total=args.max_new_tokens)
    with bar:
        result = speculative_generate(
            target, drafter, ids(args.prompt_ids), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            stop_token_ids=stop, seed=args.seed, progress=lambda n_out: bar.update(task, completed=int(n_out.max())),
        )
    print(",".join(map(str, result.tokens)))
    print(f"{result.num_tokens} tokens, {len(result.acceptance_lengths)} steps, mean acceptance length "
          f"{result.mean_acceptance_length:.2f}; prefill {result.prefill_seconds:.3f} s, decode "
          f"{result.decode_seconds:.3f} s ({result.decode_tokens_per_second:.1f} tokens/s, compilation included)",
          file=sys.stderr)
    return 0
