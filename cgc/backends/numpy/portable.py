"""Arithmetic with the same bits on every x86 CPU, at any BLAS thread count: the reference
machine's products and transcendental functions.

Two things NumPy leaves to the machine would otherwise change the reference's bits:

- `np.matmul` goes to the BLAS library, whose kernels (chosen by CPU: OPENBLAS_CORETYPE) and
  threads (OPENBLAS_NUM_THREADS) each add a product's K terms in their own order; a float32
  sum's rounding depends on that order (the quick start's losses parted at step 7).
- `np.exp`, `np.log` and `np.tanh` on float32 (and NumPy's SVML paths for exp2 and power on
  AVX-512) are NumPy's own SIMD code, one per instruction set, with different roundings:
  measured, the AVX2 path and the baseline one (NPY_DISABLE_CPU_FEATURES=X86_V3) differ.

So `matmul` (below) gives each element the float32 nearest the exact sum of its products,
a value no order of addition changes (BLAS's float64 sum, checked against its error bound,
settles nearly every element; the rest are summed exactly), and the functions are evaluated
here with only +, -, *, /, rint and frexp on float64 and integer operations on bit patterns,
which IEEE 754 defines to the bit (correctly rounded or exact) on every CPU, then rounded
once to float32. What stays NumPy's: elementwise arithmetic, sqrt, and reductions (`sum`,
`mean`, `max`), whose order is NumPy's own C (pairwise summation, no multiply to contract),
the same on every SIMD path (tests/test_portable.py runs a step with NumPy's SIMD paths
disabled, and with other BLAS kernels and thread counts: the same dump bytes).
"""

from __future__ import annotations

import functools
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
_EXP = tuple(1.0 / math.factorial(k) for k in range(14))


# ---- products ----------------------------------------------------------------------------

def _round_exact(products: np.ndarray) -> F32:
    """The float32 nearest the exact sum of float64 values (ties to even): math.fsum is
    the float64 nearest it; its residual's sign settles a float64 sum that is itself a
    float32 midpoint (where rounding twice would go wrong)."""
    terms = products.tolist()
    total = math.fsum(terms)
    nearest = F32(total)
    if float(nearest) == total or not math.isfinite(total):
        return nearest
    other = np.nextafter(nearest, F32(np.inf) if total > float(nearest) else F32(-np.inf))
    if total - float(nearest) != float(other) - total:  # not a midpoint: nearest is right
        return nearest
    residual = math.fsum(terms + [-total])
    if residual == 0:
        return nearest
    return other if (residual > 0) == (float(other) > float(nearest)) else nearest


def _bit_span(x32: np.ndarray, axis: int) -> np.ndarray:
    """Per line of float32 values along `axis`: how many bits lie between the lowest set bit
    of any of them and the highest (every value an integer multiple of 2^low, below
    2^high). Integer operations on the bit patterns: exact."""
    bits = x32.view(np.int32) & 0x7FFFFFFF
    # |x| = whole 2^(max(field, 1) - 150), whole = the fraction and, for a normal x, the
    # implicit bit 2^23; setting that bit for a subnormal too leaves the lowest set bit as
    # it is. Its lowest set bit, as a float32 power of two: its exponent field.
    whole = bits | 0x800000
    zeros = ((whole & -whole).astype(F32).view(np.int32) >> 23) - 127
    lowest = np.where(bits != 0, np.maximum(bits >> 23, 1) + zeros, 1 << 20) - 150
    _, highest = np.frexp(np.abs(x32).max(axis=axis, keepdims=True))
    low = lowest.min(axis=axis, keepdims=True)
    return np.maximum(highest - low, 0)


def _finite_product(a32: np.ndarray, b32: np.ndarray) -> np.ndarray:
    """a @ b of finite float32 operands: the float32 nearest each exact sum of products,
    whatever order BLAS adds them in. Products of float32 values are exact in float64, so
    BLAS's float64 sum C of K of them, in any order and any split between threads, FMA or
    not, is within gamma_(K-1) T of the exact sum x (T = sum |a||b|, gamma_n = n u / (1 - n u),
    u = 2^-53: Higham, Accuracy and Stability, 3.1). T comes from a float32 product of |a|
    and |b| (its own error, gamma32_K T plus K 2^-150 for underflow, in any order), and
    E = (T32 + K 2^-149) (K + 2) 2^-52 bounds |C - x| with room for the roundings of
    C - E and C + E. Where both round to the same float32, so does x, between them (rounding
    is monotonic). Where they differ, x is near a float32 rounding boundary: often exactly on
    one (operands of few bits: bfloat16 values), and then C is x itself when the row's and
    the column's bits, with K's, fit in 53 (every partial sum an exact integer of units);
    the rest are summed exactly (_round_exact)."""
    depth = a32.shape[-1]
    total = np.matmul(a32.astype(F64), b32.astype(F64))
    exact = _bit_span(a32, -1) + _bit_span(b32, -2) + (depth - 1).bit_length() <= 53
    result = total.astype(F32)
    if exact.all():
        return result + F32(0)
    bound = np.matmul(np.abs(a32), np.abs(b32), dtype=F32).astype(F64)
    bound = (bound + depth * 2.0 ** -149) * ((depth + 2) * 2.0 ** -52)
    uncertain = ((total - bound).astype(F32) != (total + bound).astype(F32)) & ~exact
    if uncertain.any():
        a64, b64 = np.broadcast_arrays(a32[..., :, None, :].astype(F64),
                                       np.swapaxes(b32, -1, -2)[..., None, :, :].astype(F64))
        for where in zip(*np.nonzero(uncertain)):
            result[where] = _round_exact(a64[where] * b64[where])
    return result + F32(0)  # + 0: every zero +0, whatever sign of zero BLAS's sum leaves


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
    """np.matmul(a, b) of float32 operands (batched on leading axes, as np.matmul): each
    element the float32 nearest the exact sum of its products, so the same bits with any
    BLAS, kernel or thread count (IEEE's Inf and NaN where a term is not finite)."""
    a, b = np.asarray(a, dtype=F32), np.asarray(b, dtype=F32)
    if a.shape[-1] == 0:
        return np.matmul(a, b) + F32(0)
    if np.isfinite(a).all() and np.isfinite(b).all():
        return _finite_product(a, b)
    with np.errstate(invalid="ignore"):
        finite = _finite_product(np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0))
        return _nonfinite(a, b, finite.astype(F64)).astype(F32)


# ---- functions ---------------------------------------------------------------------------

# Elements a function evaluates at a time. Each is computed alone (no element's value depends
# on another's), so the pieces change no bit; but a whole array's float64 temporaries, a dozen
# of them each eight bytes an element, are fresh memory the kernel may have to fault in and
# zero at every step of the series. Measured 2026-12-07 on 8 million elements, three fresh
# processes each: exp 0.22-0.91 s whole against 0.24 s in pieces, log 0.46-1.06 against
# 0.38-0.39, tanh 0.41-0.91 against 0.41: the same at best, the worst case gone
# (tests/test_portable.py checks the bits).
PIECE = 1 << 16


def _elementwise(function):
    """`function` of float32-convertible values (one array in; an array, or a tuple of them,
    out, each of the input's shape), evaluated PIECE elements at a time."""
    def pieces(x):
        x = np.asarray(x)
        if x.size <= PIECE:
            return function(x)
        flat = x.reshape(-1)
        parts = [function(flat[i:i + PIECE]) for i in range(0, flat.size, PIECE)]
        if isinstance(parts[0], tuple):
            return tuple(np.concatenate(column).reshape(x.shape) for column in zip(*parts))
        return np.concatenate(parts).reshape(x.shape)
    return functools.wraps(function)(pieces)


def _horner(x: np.ndarray, coefficients) -> np.ndarray:
    result = np.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        result *= x
        result += c
    return result


def _power_of_two(n: np.ndarray) -> np.ndarray:
    """2.0^n of integer-valued float64 n, -1022 <= n <= 1023, from its bit pattern."""
    return ((n.astype(np.int64) + 1023) << 52).view(F64)


def _exp64(x: np.ndarray) -> np.ndarray:
    """e^x for finite float64 |x| <= 700: x = n ln 2 + r, |r| <= ln2 / 2, e^r by its Taylor
    series to r^13 (relative error below 2^-55), times 2^n exactly."""
    n = np.rint(x * INV_LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    return _horner(r, _EXP) * _power_of_two(n)


def _expm1_64(y: np.ndarray) -> np.ndarray:
    """e^y - 1 for finite float64 0 <= y <= 800, without cancellation near 0."""
    small = y < 0.35
    series = y * _horner(np.where(small, y, 0), _EXP[1:])  # (e^y - 1) / y's series
    return np.where(small, series, _exp64(np.where(small, 0, y)) - 1)


def _inputs(x) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=F64)
    nan = np.isnan(x)
    return np.where(nan, 0, x), nan


@_elementwise
def exp(x) -> np.ndarray:
    """e^x of float32 values, as float32."""
    x, nan = _inputs(x)
    with np.errstate(over="ignore"):
        result = _exp64(np.clip(x, -200, 200)).astype(F32)  # past +-104: Inf or 0 in float32
    return np.where(nan, F32(np.nan), result)


@_elementwise
def exp2(x) -> np.ndarray:
    """2^x of float32 values, as float32: 2^n exactly times e^(f ln 2), f = x - n exact."""
    x, nan = _inputs(x)
    x = np.clip(x, -200, 200)
    n = np.rint(x)
    with np.errstate(over="ignore"):
        result = (_horner((x - n) * LN2, _EXP) * _power_of_two(n)).astype(F32)
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


@_elementwise
def log(x) -> np.ndarray:
    """ln x of float32 values, as float32 (0: -Inf, below 0: NaN, Inf: Inf)."""
    x, nan = _inputs(x)
    positive = (x > 0) & np.isfinite(x)
    result = _log64(np.where(positive, x, 1)).astype(F32)
    result = np.where(x == 0, F32(-np.inf), result)
    result = np.where(x == np.inf, F32(np.inf), result)
    return np.where(nan | (x < 0), F32(np.nan), result)


@_elementwise
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


@_elementwise
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


@_elementwise
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
