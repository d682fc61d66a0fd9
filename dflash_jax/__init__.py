"""dflash_jax: load and run DFlash-family speculative-decoding drafters (DFlash, DFlash2, DSpark) in JAX.

    drafter = dflash_jax.load_drafter("path/to/drafter", mesh=mesh)   # typed config + replicated params
    drafter = drafter.attach(embed=target_embed, lm_head=target_lm_head)
"""

from .config import DflashConfig, load_config, parse_config
from .errors import CheckpointError, ConfigError
from .loader import Drafter, draft_to_target_ids, load_drafter

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DflashConfig",
    "Drafter",
    "draft_to_target_ids",
    "load_config",
    "load_drafter",
    "parse_config",
]
