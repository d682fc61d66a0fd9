"""`python -m dflash_jax ...`: the `dflash-jax` command line."""

from .cli import run

run()
