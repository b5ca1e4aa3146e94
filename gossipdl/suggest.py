"""The end of an "unknown X" error: the name the user most likely meant."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """The end of an "unknown X" message: the nearest of ``known`` to ``word``, else them all.

    Example:
        >>> did_you_mean("stpes", ["steps", "seed"])
        "did you mean 'steps'?"
    """
    known = sorted(known)
    close = difflib.get_close_matches(word.replace("-", "_"), known, n=1)
    return f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
