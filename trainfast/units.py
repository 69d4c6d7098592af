"""Numbers as people read them: rates and durations that keep their significant digits.

NOTE: imports nothing; every room may use it. A rate of 0.8 images/s printed as "1" hid a
×1.39 fix behind "1 → 1 images/s" (a 512² model at batch 5); these keep 3 significant digits
below 100 and whole numbers with thousands separators above.
"""


def rate(x: float) -> str:
    """12,345 / 123 / 12.3 / 1.23 / 0.123: at least 3 significant digits, never rounded to nothing."""
    if x != x:  # NaN
        return "—"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def seconds(s: float) -> str:
    """2.5 ms / 0.84 s / 12.3 s / 524 s: durations with 2-3 significant digits."""
    if abs(s) < 0.1:
        return f"{s * 1e3:.2g} ms" if abs(s) < 0.01 else f"{s * 1e3:.0f} ms"
    return f"{s:.2g} s" if abs(s) < 1 else (f"{s:.3g} s" if abs(s) < 100 else f"{s:,.0f} s")
