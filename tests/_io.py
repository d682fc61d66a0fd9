"""Independent safetensors I/O for tests: the safetensors package's own reader, not the package under test.

safetensors.numpy looks dtypes up on the numpy module, which has no float8 types; ml_dtypes provides them
(spec nvfp4.md A10, workaround A).
"""

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

for _name in ("float8_e4m3fn", "float8_e5m2", "bfloat16"):
    if not hasattr(np, _name):
        setattr(np, _name, getattr(ml_dtypes, _name))

__all__ = ["load_file", "save_file"]
