"""Error messages of the commands: one line each."""

from __future__ import annotations


def one_line(message: object, limit: int | None = None) -> str:
    """The first non-blank line of ``message`` (a library's error may go on over several
    lines of advice), cut to ``limit`` characters; "bad input" when it has none."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    first = lines[0] if lines else "bad input"
    if limit is not None and len(first) > limit:
        first = first[:limit].rstrip() + " ..."
    return first
