"""What every quantized weight leaf (`nvfp4.Packed`, `nvfp4.Fp8Codes`, `fp8.Fp8`) answers as an array would, once.

Each leaf is a registered dataclass of arrays standing for one weight `[N, K]` (its static fields: the compute
dtype and layout facts); `WeightLeaf` gives it `ndim`, `sharding`, `nbytes` and a short repr, from its array fields,
and checks its compute dtype and (where they are arrays) its arrays when it is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

__all__ = ["WeightLeaf", "is_array_like"]


def is_array_like(x: Any) -> bool:
    """Arrays, tracers and `ShapeDtypeStruct`s (not the placeholders some tree operations unflatten with)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


class WeightLeaf:
    """A mixin for a quantized weight's dataclass (declare it with `repr=False`, so that this repr stays): `LABEL`
    names it in the repr and in errors; the subclass answers `shape`, has a `dtype` field and checks its arrays in
    `check_arrays` (ValueError)."""

    LABEL: ClassVar[str]
    shape: Any
    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(f"{self.LABEL}: dtype must be a float dtype to compute in, got {self.dtype.name}")
        arrays = self.arrays()
        if all(map(is_array_like, arrays)):  # not the placeholders some tree operations unflatten with
            self.check_arrays(*arrays)

    def check_arrays(self, *arrays: Any) -> None:
        """Raise ValueError for arrays (in field order) that do not make this leaf."""
        raise NotImplementedError

    def arrays(self) -> list[Any]:
        """The leaf's array fields, in declaration order (its static fields left out)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]  # a dataclass
                if not f.metadata.get("static")]

    def __repr__(self) -> str:  # the arrays' values would bury a drafter's repr
        arrays = self.arrays()
        if is_array_like(arrays[0]):
            return f"{self.LABEL}({list(self.shape)}, {self.dtype.name})"
        return f"{self.LABEL}({', '.join(map(repr, arrays))}, {self.dtype.name})"

    @property
    def ndim(self) -> int:
        return 2

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where its first array lives (the loader places all of them there, replicated)."""
        return self.arrays()[0].sharding

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return sum(int(a.nbytes) for a in self.arrays())
