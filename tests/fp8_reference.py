"""An independent, scalar re-statement of the quantizer contract, used to check the library's bytes.

It shares no code with `megatron_jetrl.fp8`: numpy float32 arithmetic for amax and the scale, exact
rational arithmetic for the power-of-two rounding and for round-to-nearest-even onto the E4M3 grid
(the grid itself is the decoding of all 256 codes, which is not in question).
"""

from fractions import Fraction

import numpy as np
import torch

E4M3_MAX = np.float32(448.0)
EPS = np.float32(1e-10)

_codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_FINITE = sorted((float(v), c) for c, v in enumerate(_codes) if np.isfinite(v) and not (v == 0 and c == 0x80))
_VALUES = [Fraction(v) for v, _ in _FINITE]
_CODES = [c for _, c in _FINITE]


def e4m3_rne(v: float) -> int:
    """Code of the E4M3 value nearest to v (|v| <= 448), ties to the even code (even mantissa)."""
    if v == 0:
        return 0x80 if np.signbit(v) else 0x00
    f = Fraction(float(v))
    lo, hi = 0, len(_VALUES) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _VALUES[mid] <= f:
            lo = mid
        else:
            hi = mid
    dlo, dhi = f - _VALUES[lo], _VALUES[hi] - f
    pick = lo if (dlo < dhi or (dlo == dhi and _CODES[lo] % 2 == 0)) else hi
    code = _CODES[pick]
    if _VALUES[pick] == 0:  # a value that rounds to zero keeps its sign
        code = 0x80 if v < 0 else 0x00
    return code


def ue8m0(s: np.float32) -> np.float32:
    s = max(s, np.float32(1e-10))
    p = Fraction(1)
    f = Fraction(float(s))
    while p < f:
        p *= 2
    while p / 2 >= f:
        p /= 2
    return np.float32(float(p))


def quantize_group(values: np.ndarray, scale_mode: str):
    """values: float32 array of one group. Returns (codes uint8, scale float32)."""
    amax = np.float32(np.max(np.abs(values))) if values.size else np.float32(0)
    s = np.float32(max(amax, EPS) / E4M3_MAX)
    if scale_mode == "ue8m0":
        s = ue8m0(s)
    scaled = np.clip(values / s, -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return np.array([e4m3_rne(float(v)) for v in scaled], dtype=np.uint8), s


def quantize(x: torch.Tensor, block, scale_mode: str = "fp32"):
    """Reference bytes and scales of a 2-D tensor (blocks on both dims, ceil-division)."""
    a = x.float().numpy()
    m, k = a.shape
    bm, bk = block
    codes = np.zeros((m, k), dtype=np.uint8)
    scales = np.zeros((-(-m // bm), -(-k // bk)), dtype=np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = a[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
            c, s = quantize_group(tile.reshape(-1), scale_mode)
            codes[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk] = c.reshape(tile.shape)
            scales[i, j] = s
    return torch.from_numpy(codes), torch.from_numpy(scales)
