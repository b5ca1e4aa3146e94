"""CurveZMQ keys and allow-lists: who may talk to a peer, checked at the handshake.

A peer's key pair is two files written by ``gossipdl keys generate DIR``
(``DIR/peer.key`` public, ``DIR/peer.key_secret`` secret, ZeroMQ's
certificate format). An allow-list is a text file with one public key
(40 Z85 characters) per line, optionally followed by a label; a line whose
first word starts with ``#`` (and is not a 40-character key) is a comment.
 With CURVE on, every connection is encrypted, and a connection
whose key is not on the receiver's list is refused during the handshake (ZAP),
before any message of it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq.auth

KEY_CHARS = 40  # a Z85-encoded 32-byte Curve25519 key
KEY_TRY_S = 1 / 3  # how long one allow-list key gets to reach a peer whose key is not known


class CurveError(ValueError):
    """A key file or allow-list that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Curve:
    """This peer's key pair (Z85 text) and the public keys it accepts connections from."""

    public: str
    secret: str
    allowed: frozenset[str]


def generate_keys(directory: Path, name: str = "peer") -> tuple[Path, Path]:
    """Write a new key pair into ``directory``; returns (public file, secret file)."""
    directory.mkdir(parents=True, exist_ok=True)
    secret = directory / f"{name}.key_secret"
    if secret.exists():
        raise CurveError(f"{secret} already exists; keys are never overwritten, pick another DIR")
    made = zmq.auth.create_certificates(str(directory), name)
    return Path(made[0]), Path(made[1])


def read_allow_list(path: Path) -> frozenset[str]:
    """The public keys listed in ``path`` (see the module docstring for the format)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CurveError(f"cannot read the allow-list {path}: {exc.strerror}") from None
    keys = set()
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or (words[0].startswith("#") and len(words[0]) != KEY_CHARS):
            continue  # blank, or a comment (a key may itself contain "#")
        key = words[0]
        try:
            valid = len(key) == KEY_CHARS and len(zmq.utils.z85.decode(key)) == 32
        except (ValueError, KeyError):
            valid = False
        if not valid:
            raise CurveError(
                f"{path} line {number}: {key[:60]!r} is not a public key ({KEY_CHARS} Z85 "
                "characters, as in a .key file written by gossipdl keys generate)"
            )
        keys.add(key)
    if not keys:
        raise CurveError(f"the allow-list {path} lists no key; nobody could connect")
    return frozenset(keys)


def load_curve_public(path: Path) -> str:
    """The public key (Z85 text) in a ``.key`` file."""
    public, _ = zmq.auth.load_certificate(str(path))
    return public.decode()


def load_curve(keys: Path, allow: Path) -> Curve:
    """This peer's key pair from the directory ``keys`` and the allow-list file ``allow``."""
    secrets = sorted(keys.glob("*.key_secret")) if keys.is_dir() else []
    if len(secrets) != 1:
        found = "none" if not secrets else ", ".join(p.name for p in secrets)
        raise CurveError(
            f"{keys} must hold exactly one *.key_secret file (found {found}); "
            "make one with: gossipdl keys generate DIR"
        )
    try:
        public, secret = zmq.auth.load_certificate(str(secrets[0]))
    except (OSError, ValueError) as exc:
        raise CurveError(f"{secrets[0]} is not a key file: {exc}") from None
    if secret is None:
        raise CurveError(f"{secrets[0]} holds no secret key")
    return Curve(public.decode(), secret.decode(), read_allow_list(allow))


def listed_key(curve: Curve, attempt: int) -> str:
    """The allow-list key to dial a peer whose key is not known yet with, on try ``attempt``
    (round robin, every ``KEY_TRY_S``): only the right one gets through the handshake."""
    keys = sorted(curve.allowed)
    return keys[attempt % len(keys)]
