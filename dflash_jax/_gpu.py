"""Which GPU the package's Pallas kernels compile for."""

import jax


def hopper_or_newer() -> bool:
    """Whether the default device is a GPU that Pallas Mosaic GPU compiles for (compute capability 9.0 or more)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", 0)) >= 9.0
