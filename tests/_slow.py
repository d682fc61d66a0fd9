"""Tests that take minutes on 2 CPU cores (whole scripts compiling many programs): run with DFLASH_JAX_SLOW_TESTS=1."""

import os

import pytest

slow = pytest.mark.skipif(not os.environ.get("DFLASH_JAX_SLOW_TESTS"),
                          reason="minutes on 2 CPU cores: DFLASH_JAX_SLOW_TESTS=1 runs it")
