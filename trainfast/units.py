"""Numbers as people read them: rates and milliseconds that keep their significant digits; and
arguments of a printed command, quoted for pasting into a shell (`shell_arg`).

NOTE: imports nothing of ours; every room may use it. A rate of 0.8 images/s printed as "1" hid a
×1.39 fix behind "1 → 1 images/s" (a 512² model at batch 5); these keep 3 significant digits
below 100 and whole numbers with thousands separators above.
"""

import shlex


def shell_arg(text, path: bool = False) -> str:
    """One argument of a command printed for pasting: shell-quoted (a folder named `photos $(id)`
    stays one argument and runs nothing); a name with a newline or another control character
    as bash/zsh/POSIX-2024 `$'...'` (plain quotes would hold the newline, and an indented report
    puts spaces inside them); a path that begins with `-` as `./-name` (an option otherwise)."""
    text = str(text)
    if path and text.startswith("-"):
        text = "./" + text
    if not any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        return shlex.quote(text)
    escaped = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return "$'" + "".join(escaped.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch)
                          for ch in text) + "'"


def rate(x: float) -> str:
    """12,345 / 123 / 12.3 / 1.23 / 0.123: at least 3 significant digits, never rounded to nothing."""
    if x != x:  # NaN
        return "—"
    return f"{x:,.0f}" if abs(x) >= 99.95 else f"{x:#.3g}"  # 99.96 would be "100."


def ms(s: float) -> str:
    """Seconds as milliseconds with 3 significant digits: 0.0202 ms, 0.724 ms, 55.7 ms, 1,234 ms."""
    return rate(s * 1e3)


def minutes(m: float) -> str:
    """A time budget in words: '5 minutes', '2.18 minutes', '8.38 s'."""
    if m < 1:
        return f"{60 * m:.3g} s"
    return f"{m:.3g} minute{'s' * (m != 1)}"


def duration(s: float) -> str:
    """A wall time in words: '8.4 s', '12 min', '3 h 05 min'."""
    if s < 60:
        return f"{s:.2g} s" if s < 10 else f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    h, m = divmod(round(s / 60), 60)
    return f"{h} h {m:02d} min"
