"""Which GPU the package's Pallas kernels compile for."""

import jax


def _compute_capability() -> float:
    """The default device's CUDA compute capability (9.0 on a Hopper), 0 off a GPU."""
    device = jax.devices()[0]
    return float(getattr(device, "compute_capability", 0)) if device.platform == "gpu" else 0.0


def hopper_or_newer() -> bool:
    """Whether the default device is a GPU that Pallas Mosaic GPU compiles for (compute capability 9.0 or more)."""
    return _compute_capability() >= 9.0


def hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.0: WGMMA, which later GPUs do not have)."""
    return _compute_capability() == 9.0
