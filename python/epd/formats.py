"""Number formats of the epd buffers, in NumPy: BF16 (as uint16 bit patterns) and FP8 e4m3 (as uint8).

These match daemon/ref.c (docs/SEMANTICS.md): float32 -> bf16 rounds to nearest even (NaN stays NaN);
float32 -> e4m3 rounds to nearest even and saturates to +-448 (satfinite; NaN -> 0x7f); FP8 dispatch
quantises per 128-channel block with scale = max(amax(|x|), 1e-4) / 448.
"""

import numpy as np

__all__ = [
    "f32_to_bf16", "bf16_to_f32", "round_bf16", "e4m3_to_f32", "f32_to_e4m3", "quantize_fp8",
    "dequantize_fp8", "scale_blocks", "FP8_MAX",
]

FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_MIN_AMAX = 1e-4


def f32_to_bf16(x):
    """float array -> uint16 bf16 bit patterns (round to nearest even; NaN stays a quiet NaN)."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_to_f32(b):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    b = np.asarray(b)
    if b.dtype not in (np.uint16, np.int16):
        raise TypeError("bf16_to_f32 expects uint16 bit patterns, got dtype %s" % b.dtype)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x):
    """Round float values to the nearest bf16 value, returned as float32."""
    return bf16_to_f32(f32_to_bf16(x))


def _e4m3_table():
    t = np.zeros(256, dtype=np.float32)
    for code in range(256):
        s = -1.0 if code & 0x80 else 1.0
        e = (code >> 3) & 0xF
        m = code & 0x7
        if e == 0xF and m == 0x7:
            t[code] = np.nan
        elif e == 0:
            t[code] = s * (m / 8.0) * 2.0 ** -6
        else:
            t[code] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


_E4M3 = _e4m3_table()
_E4M3_POS = _E4M3[:0x7F].astype(np.float64)  # codes 0..126: the finite non-negative values, increasing


def e4m3_to_f32(q):
    """uint8 FP8 e4m3 codes -> float32."""
    q = np.asarray(q)
    if q.dtype != np.uint8:
        raise TypeError("e4m3_to_f32 expects uint8 codes, got dtype %s" % q.dtype)
    return _E4M3[q]


def f32_to_e4m3(x):
    """float array -> uint8 e4m3 codes (round to nearest even, saturating to +-448, NaN -> 0x7f)."""
    f = np.asarray(x, dtype=np.float32)
    a = np.minimum(np.abs(f).astype(np.float64), FP8_MAX)
    hi = np.clip(np.searchsorted(_E4M3_POS, a, side="left"), 0, 0x7E)
    lo = np.maximum(hi - 1, 0)
    dlo = a - _E4M3_POS[lo]
    dhi = _E4M3_POS[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(f) & (code != 0), code | np.uint8(0x80), code).astype(np.uint8)
    nan = np.isnan(f)
    if nan.any():
        code[nan] = 0x7F
    return code


def scale_blocks(hidden):
    """Number of 128-channel scale blocks of a row."""
    return (int(hidden) + FP8_BLOCK - 1) // FP8_BLOCK


def quantize_fp8(x_bf16):
    """Quantise rows of bf16 (uint16 [..., H]) to (e4m3 codes uint8 [..., H], scales float32 [..., H/128])."""
    x = bf16_to_f32(x_bf16)
    h = x.shape[-1]
    nb = scale_blocks(h)
    pad = nb * FP8_BLOCK - h
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x
    blocks = xp.reshape(x.shape[:-1] + (nb, FP8_BLOCK))
    amax = np.abs(blocks).max(axis=-1)
    scales = (np.maximum(amax, np.float32(FP8_MIN_AMAX)) / np.float32(FP8_MAX)).astype(np.float32)
    q = f32_to_e4m3((blocks / scales[..., None]).astype(np.float32))
    return q.reshape(xp.shape)[..., :h], scales


def dequantize_fp8(q, scales):
    """(uint8 e4m3 [..., H], float32 scales [..., H/128]) -> float32 [..., H]."""
    v = e4m3_to_f32(q)
    h = v.shape[-1]
    s = np.repeat(np.asarray(scales, dtype=np.float32), FP8_BLOCK, axis=-1)[..., :h]
    return v * s
