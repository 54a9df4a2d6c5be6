"""Arithmetic with the same bits on every x86 CPU, at any BLAS thread count: the reference
machine's products and transcendental functions.

Two things NumPy leaves to the machine would otherwise change the reference's bits:

- `np.matmul` goes to the BLAS library, whose kernels (chosen by CPU: OPENBLAS_CORETYPE) and
  threads (OPENBLAS_NUM_THREADS) each add a product's K terms in their own order; a float32
  sum's rounding depends on that order (the quick start's losses parted at step 7).
- `np.exp`, `np.log` and `np.tanh` on float32 (and NumPy's SVML paths for exp2 and power on
  AVX-512) are NumPy's own SIMD code, one per instruction set, with different roundings:
  measured, the AVX2 path and the baseline one (NPY_DISABLE_CPU_FEATURES=X86_V3) differ.

So `matmul` (below) makes every sum BLAS computes exact, whatever its order, and the
functions are evaluated here with only +, -, *, /, rint, trunc, frexp and ldexp on float64,
operations IEEE 754 defines to the bit (correctly rounded or exact) on every CPU, then rounded
once to float32. What stays NumPy's: elementwise arithmetic, sqrt, and reductions (`sum`,
`mean`, `max`), whose order is NumPy's own C (pairwise summation, no multiply to contract),
the same on every SIMD path (tests/test_reference.py runs them with the SIMD paths disabled).
"""

from __future__ import annotations

import math

import numpy as np

F32, F64 = np.float32, np.float64

# ln 2 in two parts (fdlibm's): n * LN2_HI is exact for |n| < 2^20, its low 32 bits zero.
LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
LN2 = 0.6931471805599453
INV_LN2 = 1.4426950408889634
PI = 3.141592653589793
LN_10000 = 9.210340371976184
# Taylor coefficients 1/k!: Python's float division is IEEE's, the same everywhere.
_EXP = tuple(1.0 / math.factorial(k) for k in range(15))


# ---- products ----------------------------------------------------------------------------

def _slices(x: np.ndarray, top: np.ndarray, bits: int):
    """x (float64, finite) as 2^e (hi + lo 2^-bits) 2^-bits, e per line (`top`: its largest
    magnitude, below 2^e), hi and lo integers below 2^bits in magnitude, and 2^(e - bits).
    Exact for every element within 2^-(2 bits - 24) of its line's largest; smaller ones lose
    their lowest bits (an error below 2^-2bits of the line's largest element)."""
    _, exponent = np.frexp(top)  # top < 2^exponent; an all-zero line: 0
    scaled = x * np.ldexp(F64(1), bits - exponent)  # times a power of two: exact
    hi = np.trunc(scaled)
    lo = np.trunc((scaled - hi) * F64(2.0 ** bits))  # scaled - hi: the fraction, exact
    return hi, lo, np.ldexp(F64(1), exponent - bits)


def _finite_product(a: np.ndarray, b: np.ndarray, a_top: np.ndarray,
                    b_top: np.ndarray) -> np.ndarray:
    """a @ b of finite float64 operands holding float32 values, in float64, the same bits
    whatever BLAS does: each operand is cut into two slices of integers below 2^bits (a's per
    row, b's per column; `a_top`, `b_top`: their largest magnitudes), with
    2 bits + log2 K <= 53. Every term of a slice product is then an integer, and every partial
    sum of K of them an integer below 2^53: exactly representable, so each addition BLAS
    makes, FMA or not, in any order and any split between threads, is exact, and its result
    the exact sum. The four exact products are combined here, in a fixed order."""
    depth = a.shape[-1]
    bits = (53 - max(depth - 1, 1).bit_length()) // 2
    a_hi, a_lo, a_scale = _slices(a, a_top, bits)  # a_scale: [..., M, 1]
    b_hi, b_lo, b_scale = _slices(b, b_top, bits)  # b_scale: [..., 1, N]
    high, low = np.matmul(a_hi, b_hi), np.matmul(a_lo, b_lo)
    middle = np.matmul(a_hi, b_lo) + np.matmul(a_lo, b_hi)  # each exact: one rounding here
    units = (middle + low * F64(2.0 ** -bits)) * F64(2.0 ** -bits) + high
    # times 2^(ea - bits) 2^(eb - bits): powers of two, exact (float32 operands keep every
    # value above float64's underflow); + 0.0 makes every zero +0, whatever sign of zero a
    # BLAS kernel's first addition leaves
    return units * a_scale * b_scale + F64(0)


def _nonfinite(a: np.ndarray, b: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """IEEE's sum of the products where a term is Inf or NaN: NaN where a term is NaN (a NaN
    operand, Inf * 0) or where +Inf and -Inf terms meet, else the infinite terms' sign; the
    finite result elsewhere. Counted with products of 0/1 matrices: exact integers."""
    def count(x, y):
        return np.matmul(x.astype(F64), y.astype(F64))

    def any_row(mask):
        return mask.any(axis=-1, keepdims=True)

    nan = any_row(np.isnan(a)) | np.isnan(b).any(axis=-2, keepdims=True)
    a_inf, b_inf = np.isinf(a), np.isinf(b)
    nan = nan | (count(a_inf, b == 0) > 0) | (count(a == 0, b_inf) > 0)
    a_pos, a_neg, b_pos, b_neg = a > 0, a < 0, b > 0, b < 0
    positive = count(a_inf & a_pos, b_pos) + count(a_inf & a_neg, b_neg) + \
        count(a_pos, b_inf & b_pos) + count(a_neg, b_inf & b_neg)
    negative = count(a_inf & a_pos, b_neg) + count(a_inf & a_neg, b_pos) + \
        count(a_pos, b_inf & b_neg) + count(a_neg, b_inf & b_pos)
    nan = nan | ((positive > 0) & (negative > 0))
    result = np.where(positive > 0, F64(np.inf), finite)
    result = np.where(negative > 0, F64(-np.inf), result)
    return np.where(nan, F64(np.nan), result)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """np.matmul(a, b) of float32 operands (batched on leading axes, as np.matmul), rounded
    once to float32 from float64: the same bits with any BLAS, kernel or thread count."""
    a, b = np.asarray(a, dtype=F64), np.asarray(b, dtype=F64)
    if a.shape[-1] == 0:
        return np.matmul(a, b).astype(F32)
    a_top = np.abs(a).max(axis=-1, keepdims=True)  # NaN where a line holds a NaN
    b_top = np.abs(b).max(axis=-2, keepdims=True)
    if np.isfinite(a_top).all() and np.isfinite(b_top).all():
        return _finite_product(a, b, a_top, b_top).astype(F32)
    finite_a, finite_b = np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0)
    product = _finite_product(finite_a, finite_b,
                              np.abs(finite_a).max(axis=-1, keepdims=True),
                              np.abs(finite_b).max(axis=-2, keepdims=True))
    with np.errstate(invalid="ignore"):
        return _nonfinite(a, b, product).astype(F32)


# ---- functions ---------------------------------------------------------------------------

def _horner(x: np.ndarray, coefficients) -> np.ndarray:
    result = np.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result = result * x + F64(c)
    return result


def _exp64(x: np.ndarray) -> np.ndarray:
    """e^x for finite float64 |x| <= 800: x = n ln 2 + r, |r| <= ln2 / 2, e^r by its Taylor
    series to r^14 (relative error below 2^-60), times 2^n exactly."""
    n = np.rint(x * INV_LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    return np.ldexp(_horner(r, _EXP), n.astype(np.int64))


def _expm1_64(y: np.ndarray) -> np.ndarray:
    """e^y - 1 for finite float64 0 <= y <= 800, without cancellation near 0."""
    small = y < 0.35
    series = y * _horner(np.where(small, y, 0), _EXP[1:])  # (e^y - 1) / y's series
    return np.where(small, series, _exp64(np.where(small, 0, y)) - 1)


def _inputs(x) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=F64)
    nan = np.isnan(x)
    return np.where(nan, 0, x), nan


def exp(x) -> np.ndarray:
    """e^x of float32 values, as float32."""
    x, nan = _inputs(x)
    with np.errstate(over="ignore"):
        result = _exp64(np.clip(x, -200, 200)).astype(F32)  # past +-104: Inf or 0 in float32
    return np.where(nan, F32(np.nan), result)


def exp2(x) -> np.ndarray:
    """2^x of float32 values, as float32: 2^n exactly times e^(f ln 2), f = x - n exact."""
    x, nan = _inputs(x)
    x = np.clip(x, -200, 200)
    n = np.rint(x)
    with np.errstate(over="ignore"):
        result = np.ldexp(_horner((x - n) * LN2, _EXP), n.astype(np.int64)).astype(F32)
    return np.where(nan, F32(np.nan), result)


def _log64(x: np.ndarray) -> np.ndarray:
    """ln x for finite float64 x > 0: x = m 2^e, sqrt(1/2) <= m < sqrt(2), ln m = 2 atanh(s),
    s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^25 (relative error below 2^-60)."""
    m, e = np.frexp(x)
    low = m < 0.7071067811865476
    m = np.where(low, m * 2, m)  # exact
    e = (e - low).astype(F64)
    s = (m - 1) / (m + 1)  # m - 1 exact (Sterbenz)
    series = _horner(s * s, tuple(1.0 / (2 * k + 1) for k in range(13)))
    return (e * LN2_LO + 2 * s * series) + e * LN2_HI


def log(x) -> np.ndarray:
    """ln x of float32 values, as float32 (0: -Inf, below 0: NaN, Inf: Inf)."""
    x, nan = _inputs(x)
    positive = (x > 0) & np.isfinite(x)
    result = _log64(np.where(positive, x, 1)).astype(F32)
    result = np.where(x == 0, F32(-np.inf), result)
    result = np.where(x == np.inf, F32(np.inf), result)
    return np.where(nan | (x < 0), F32(np.nan), result)


def tanh(x) -> np.ndarray:
    """tanh x of float32 values, as float32: t / (t + 2), t = e^(2|x|) - 1, with x's sign.
    Past |x| = 10 tanh is 1 in float32 (1 - 4e-9)."""
    x, nan = _inputs(x)
    magnitude = np.minimum(np.abs(x), 10)
    t = _expm1_64(2 * magnitude)
    result = np.copysign(t / (t + 2), x).astype(F32)
    return np.where(nan, F32(np.nan), result)


def power_of_10000(y) -> np.ndarray:
    """10000^y of float32 values, as float32 (the rotary frequencies)."""
    return exp_of_64(np.asarray(y, dtype=F64) * LN_10000)


def exp_of_64(x: np.ndarray) -> np.ndarray:
    """e^x of finite float64 values, as float32."""
    with np.errstate(over="ignore"):
        return _exp64(np.clip(x, -200, 200)).astype(F32)


def power(base, exponent: int) -> F32:
    """base^exponent for a finite float32 base and an integer exponent >= 0, as float32
    (Adam's bias corrections): |base|^exponent = e^(exponent ln |base|) in float64."""
    base = float(base)
    if base == 0 or exponent == 0:
        return F32(1) if exponent == 0 else F32(0)
    magnitude = exp_of_64(np.array(exponent * _log64(np.array(abs(base)))))
    return F32(-magnitude if base < 0 and exponent % 2 else magnitude)


def cos_sin_pi(turns) -> tuple[np.ndarray, np.ndarray]:
    """cos(pi t) and sin(pi t) of float32 half-turns t, as float32: t = n / 2 + r, |r| <= 1/4
    (exact), the quadrant n mod 4 chosen, cos and sin of pi r by their series (to r^20)."""
    t = np.asarray(turns, dtype=F64)
    n = np.rint(2 * t)
    x = (t - n / 2) * PI  # t - n / 2 exact: |r| <= 1/4, on t's own grid
    x2 = x * x
    cos = _horner(x2, tuple((-1) ** k / math.factorial(2 * k) for k in range(11)))
    sin = x * _horner(x2, tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(11)))
    quadrant = n.astype(np.int64) % 4
    cos_t = np.choose(quadrant, [cos, -sin, -cos, sin])
    sin_t = np.choose(quadrant, [sin, cos, -sin, -cos])
    return (cos_t + 0).astype(F32), (sin_t + 0).astype(F32)  # + 0: every zero +0
