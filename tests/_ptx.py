"""A NumPy model of the PTX instructions the package's inline-PTX decodes use (NVIDIA's PTX ISA), run on u32
arrays, so that the CPU tests check the very strings the kernels hand to the GPU.

Registers are named `$0` (the result) and `$1`, `$2`, ... (the inputs) or declared with `.reg`; every register is
32 bits and any 32-bit instruction may read it (PTX's bit-size types are compatible with any type of their size).
Floating point follows the ISA's defaults: round to nearest even, subnormals kept (no `.ftz`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def _f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


def _halves(word: np.ndarray, dtype) -> list[np.ndarray]:
    """A u32 as its (low, high) 16-bit halves read as `dtype`."""
    return [((word >> np.uint32(s)) & np.uint32(0xFFFF)).astype(np.uint16).view(dtype) for s in (0, 16)]


def _pack(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return low.view(np.uint16).astype(np.uint32) | (high.view(np.uint16).astype(np.uint32) << np.uint32(16))


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """prmt.b32 (default mode): byte i of d is byte (c's nibble i & 7) of {b, a}, or, where that nibble's bit 3 is
    set, that byte's sign bit replicated."""
    source = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    d = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for i in range(4):
        nibble = (c >> np.uint32(4 * i)) & np.uint32(15)
        byte = ((source >> (np.uint64(8) * (nibble & np.uint32(7)).astype(np.uint64))) & np.uint64(255))
        byte = np.where(nibble & np.uint32(8), np.where(byte & np.uint64(0x80), np.uint64(255), np.uint64(0)), byte)
        d |= byte.astype(np.uint32) << np.uint32(8 * i)
    return d


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """lop3.b32: bit i of d = bit (4 a_i + 2 b_i + c_i) of the LUT (a, b, c standing for 0xF0, 0xCC, 0xAA)."""
    d = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
    for bit in range(8):
        if lut >> bit & 1:
            pick = lambda v, on: v if on else ~v  # noqa: E731
            d |= pick(a, bit >> 2 & 1) & pick(b, bit >> 1 & 1) & pick(c, bit & 1)
    return d


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (a0, a1), (b0, b1) = _halves(a, ml_dtypes.bfloat16), _halves(b, ml_dtypes.bfloat16)
    product = [(x.astype(np.float64) * y.astype(np.float64)).astype(ml_dtypes.bfloat16)
               for x, y in ((a0, b0), (a1, b1))]
    return _pack(*product)


_CVT_X2 = {"cvt.rn.bf16x2.f32": ml_dtypes.bfloat16, "cvt.rn.f16x2.f32": np.float16}


def run_ptx(ptx: str, *inputs: np.ndarray) -> np.ndarray:
    """Runs `ptx` with inputs `$1, $2, ...` (u32 arrays, broadcast together; pass float32 operands as their bits)
    and returns `$0`. An instruction outside the model fails the test."""
    regs = {f"${i + 1}": np.asarray(x).astype(np.uint32) for i, x in enumerate(inputs)}

    def value(operand: str) -> np.ndarray:
        if operand in regs:
            return regs[operand]
        if operand.startswith("0f"):  # a float32 immediate, by its bits
            return np.uint32(int(operand[2:], 16))
        return np.uint32(int(operand, 0))

    for line in ptx.splitlines():
        op, _, args = line.strip().rstrip(";").partition(" ")
        if op in ("", "{", "}", ".reg"):
            continue
        d, *a = [x.strip() for x in args.split(",")]
        if op in ("shl.b32", "shr.b32"):  # shifts past 31 give 0 (PTX clamps the amount to 32)
            x, amount = value(a[0]), int(a[1])
            if amount > 31:
                regs[d] = np.zeros_like(x)
            else:
                regs[d] = x << np.uint32(amount) if op == "shl.b32" else x >> np.uint32(amount)
            continue
        v = [value(x) for x in a]
        if op == "and.b32":
            regs[d] = v[0] & v[1]
        elif op == "mov.b32":
            regs[d] = np.asarray(v[0], np.uint32)
        elif op == "prmt.b32":
            regs[d] = _prmt(*v)
        elif op == "lop3.b32":
            regs[d] = _lop3(v[0], v[1], v[2], int(a[3], 0))
        elif op == "sub.f32":  # rounded once: float64 holds the difference of the decode's operands (8 + |v|, 8)
            regs[d] = _bits((_f32(v[0]).astype(np.float64) - _f32(v[1]).astype(np.float64)).astype(np.float32))
        elif op == "mul.rn.f32":  # a product of two float32 is exact in float64 (48 significant bits)
            regs[d] = _bits((_f32(v[0]).astype(np.float64) * _f32(v[1]).astype(np.float64)).astype(np.float32))
        elif op == "mul.rn.bf16x2":
            regs[d] = _mul_bf16x2(v[0], v[1])
        elif op in _CVT_X2:  # d = (a rounded: high half, b rounded: low half); past the range: Inf
            dtype = _CVT_X2[op]
            with np.errstate(over="ignore"):
                regs[d] = _pack(_f32(v[1]).astype(dtype), _f32(v[0]).astype(dtype))
        else:
            raise AssertionError(f"unmodelled PTX: {line}")
    return regs["$0"]
