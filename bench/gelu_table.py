"""Fits kernels/int8_linear_gelu.h's table: Phi(x) (the normal CDF, GELU(x) = x Phi(x)) on [-C, C] in 30 equal
pieces, each a degree-4 polynomial in the piece's own t in [0, 1), weighted by max(|x|, 1) since GELU's error is x
times Phi's; near-minimax by Lawson's iteratively reweighted least squares on Chebyshev nodes, in float64. Lane 0 of
each table (below -C) is 0 and lane 31 (above C) is 1, so GELU is exactly 0 x x and x there. Prints the C table and
the fit's worst GELU error against float64, before float32 rounding (tests/test_int8.py checks the kernel's).

    .venv/bin/python bench/gelu_table.py
"""

from __future__ import annotations

import math

import numpy as np

C = 5.4  # |x| from which x (1 - Phi(|x|)) < 2e-7: GELU is 0 or x to float32's precision there
PIECES, DEGREE, NODES, ITERATIONS = 30, 4, 200, 60
_phi = np.vectorize(lambda x: 0.5 * math.erfc(-x / math.sqrt(2)))


def fit_piece(start: float, width: float) -> tuple[np.ndarray, float]:
    """Coefficients (t^0 first) of Phi(start + width t) on [0, 1], and the worst weighted error at the nodes."""
    t = (1 - np.cos(np.pi * (np.arange(NODES) + 0.5) / NODES)) / 2
    x = start + width * t
    weight = np.maximum(np.abs(x), 1.0)
    powers = np.vander(t, DEGREE + 1, increasing=True)
    target = _phi(x)
    lawson = np.full(NODES, 1 / NODES)
    for _ in range(ITERATIONS):
        scale = np.sqrt(lawson) * weight
        coefficients = np.linalg.lstsq(powers * scale[:, None], target * scale, rcond=None)[0]
        error = np.abs(powers @ coefficients - target) * weight
        lawson = lawson * error / (lawson * error).sum()
    return coefficients, float(error.max())


def _c_float(value: float) -> str:
    text = f"{float(np.float32(value)):.9g}"
    return f"{text}f" if "." in text or "e" in text else f"{text}.0f"


def main() -> None:
    width = 2 * C / PIECES
    table = np.zeros((DEGREE + 1, PIECES + 2))
    table[0, PIECES + 1] = 1.0
    worst = 0.0
    for piece in range(PIECES):
        coefficients, error = fit_piece(-C + piece * width, width)
        table[:, piece + 1] = coefficients
        worst = max(worst, error)
    print(f"// C = {C}, {PIECES} pieces, degree {DEGREE}: the fit's GELU error <= {worst:.2e} (float64)")
    print(f"static const float GELU_TABLE[{DEGREE + 1}][{PIECES + 2}] = {{")
    for row in table:
        values = ", ".join(_c_float(v) for v in row)
        print(f"    {{{values}}},")
    print("};")


if __name__ == "__main__":
    main()
