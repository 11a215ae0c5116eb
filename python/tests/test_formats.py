"""BF16 and FP8 conversions of epd.formats (no daemon needed)."""

import numpy as np
import pytest

from epd import formats


def test_bf16_round_to_nearest_even():
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 0.0, -0.0, np.inf, -np.inf], np.float32)
    b = formats.f32_to_bf16(x)
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(b, [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x0000, 0x8000, 0x7F80, 0xFF80])
    np.testing.assert_array_equal(formats.bf16_to_f32(b), [1, 1, 1 + 2 ** -6, -2.5, 0, 0, np.inf, -np.inf])


def test_bf16_nan_stays_nan():
    b = formats.f32_to_bf16(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(formats.bf16_to_f32(b)).all()


def test_bf16_matches_exhaustive_reference():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    f = f[np.isfinite(f) & (np.abs(f) < 1e38)]  # away from the overflow to inf
    got = formats.f32_to_bf16(f)
    # Reference: pick the nearer of the two truncations, ties to even, in float64.
    lo = (f.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    hi_bits = (f.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)
    hi = hi_bits.view(np.float32).astype(np.float64)
    d_lo, d_hi = np.abs(f - lo), np.abs(hi - f)
    lo_even = ((f.view(np.uint32) >> 16) & 1) == 0
    want = np.where((d_lo < d_hi) | ((d_lo == d_hi) & lo_even), f.view(np.uint32) >> 16, hi_bits >> 16)
    np.testing.assert_array_equal(got, want.astype(np.uint16))


def test_bf16_to_f32_rejects_floats():
    with pytest.raises(TypeError, match="uint16"):
        formats.bf16_to_f32(np.zeros(3, np.float32))


def test_e4m3_every_code_round_trips():
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF, 0x80)], np.uint8)
    v = formats.e4m3_to_f32(codes)
    np.testing.assert_array_equal(formats.f32_to_e4m3(v), codes)
    assert formats.e4m3_to_f32(np.array([0x7E], np.uint8))[0] == 448.0
    assert np.isnan(formats.e4m3_to_f32(np.array([0x7F], np.uint8))[0])


def test_e4m3_rounding_and_saturation():
    x = np.array([1.0625, 1.1875, 500.0, -1e9, 2 ** -10, 1.5 * 2 ** -10, np.nan], np.float32)
    q = formats.f32_to_e4m3(x)
    v = formats.e4m3_to_f32(q)
    assert v[0] == 1.0  # tie between 1.0 and 1.125 -> even
    assert v[1] == 1.25  # tie between 1.125 and 1.25 -> even
    assert v[2] == 448.0 and v[3] == -448.0  # satfinite
    assert v[4] == 0.0  # half of the smallest subnormal: tie -> even (0)
    assert v[5] == 2 ** -9
    assert q[6] == 0x7F


def test_quantize_fp8_blocks():
    rng = np.random.default_rng(2)
    x = formats.f32_to_bf16(rng.standard_normal((5, 384)).astype(np.float32) * 3)
    x[1, :128] = 0  # an all-zero block gets the minimum scale
    q, s = formats.quantize_fp8(x)
    assert q.shape == (5, 384) and q.dtype == np.uint8
    assert s.shape == (5, 3) and s.dtype == np.float32
    xf = formats.bf16_to_f32(x)
    amax = np.abs(xf.reshape(5, 3, 128)).max(-1)
    np.testing.assert_allclose(s, np.maximum(amax, 1e-4) / 448, rtol=1e-6)
    back = formats.dequantize_fp8(q, s)
    np.testing.assert_allclose(back, xf, rtol=1 / 16, atol=float(s.max()) * 2 ** -9)
    assert np.abs(formats.e4m3_to_f32(q)).max() <= 448
