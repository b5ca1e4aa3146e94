"""Whole numbers in text from outside (the network, environment variables, specs, file
names): ASCII digits only, since ``str.isdigit`` also takes ``²`` and ``①``, which ``int``
refuses with a ValueError the caller did not expect."""

from __future__ import annotations


def is_decimal(text: str) -> bool:
    """Whether ``text`` is a plain decimal number: one or more ASCII digits, nothing else.

    Example:
        >>> is_decimal("42"), is_decimal("²"), is_decimal(""), is_decimal("-1")
        (True, False, False, False)
    """
    return text.isascii() and text.isdigit()
