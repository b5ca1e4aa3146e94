"""What a CURVE public key is, with no ZeroMQ: 40 Z85 characters that decode to 32 bytes
(the protocol core checks the keys in member tables with it; :mod:`~gossipdl.transport.curve`
the keys in files)."""

from __future__ import annotations

from typing import Any

KEY_CHARS = 40  # a Z85-encoded 32-byte Curve25519 key
Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_DIGITS = {char: value for value, char in enumerate(Z85)}


def is_curve_key(value: Any) -> bool:
    """Whether ``value`` is a Z85 text of 32 bytes: every 5 characters Z85 digits whose
    number fits 4 bytes (ZeroMQ refuses any other key when a socket connects with it).

    Example:
        >>> key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
        >>> is_curve_key(key), is_curve_key("~" * 40), is_curve_key("#" * 40), is_curve_key(key[1:])
        (True, False, False, False)
    """
    if not isinstance(value, str) or len(value) != KEY_CHARS:
        return False
    for start in range(0, KEY_CHARS, 5):
        number = 0
        for char in value[start : start + 5]:
            digit = _DIGITS.get(char)
            if digit is None:
                return False
            number = number * 85 + digit
        if number >= 2**32:
            return False
    return True
