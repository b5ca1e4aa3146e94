"""CurveZMQ keys and allow-lists: who may talk to a peer, checked at the handshake.

A peer's key pair is two files written by ``gossipdl keys generate DIR``
(``DIR/NAME.key`` public, ``DIR/NAME.key_secret`` secret, ZeroMQ's
certificate format with the pair's name as ``name`` metadata). The secret
file is created with mode 0600 and, as ssh does, refused when group or others
may read or write it. An allow-list is a text file with one public key
(40 Z85 characters) per line, optionally followed by a label (``KEY  # NAME``);
a line whose first word starts with ``#`` (and is not a 40-character key) is
a comment. With CURVE on, every connection is encrypted, and a connection
whose key is not on the receiver's list is refused during the handshake (ZAP),
before any message of it is read.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
import zmq.auth

from gossipdl.transport.key_syntax import KEY_CHARS, is_curve_key

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a key name is a file stem
_SECRET_MODE, _PUBLIC_MODE = 0o600, 0o644


class CurveError(ValueError):
    """A key file or allow-list that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Curve:
    """This peer's key pair (Z85 text), the public keys it accepts connections from, and
    ``known``: the keys already found of addresses dialled before (a bootstrap member's,
    found while asking it for the swarm's config), so a join does not search again."""

    public: str
    secret: str
    allowed: frozenset[str]
    known: tuple[tuple[str, str], ...] = ()  # (address, its key)

    def knowing(self, address: str, key: str) -> Curve:
        """These settings, knowing that the peer at ``address`` holds ``key``."""
        return replace(self, known=(*self.known, (address, key)))

    def key_of(self, address: str) -> str | None:
        """The key found for ``address`` (None: not known yet)."""
        return dict(self.known).get(address)


def generate_keys(directory: Path, name: str = "peer") -> tuple[Path, Path]:
    """Write a new key pair labelled ``name`` into ``directory``; returns (public file, secret
    file). The secret file is created with mode 0600: it is never readable by others."""
    if not _NAME.fullmatch(name):
        raise CurveError(
            f"key name {name!r} cannot be a file name: use letters, digits, '_', '-' and "
            "(not first) '.'"
        )
    directory.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_file, secret_file):
        if path.exists():
            raise CurveError(
                f"{path} already exists; keys are never overwritten, pick another DIR or --name"
            )
    public, secret = (key.decode() for key in zmq.curve_keypair())
    _write_key_file(secret_file, _SECRET_MODE, name, public, secret)
    _write_key_file(public_file, _PUBLIC_MODE, name, public)
    return public_file, secret_file


def _write_key_file(path: Path, mode: int, name: str, public: str, secret: str = "") -> None:
    """One certificate file (``secret``: the secret one), created with ``mode`` from the start."""
    what = "secret key: keep it private, mode 0600" if secret else "public key: share it"
    text = (
        f"#   gossipdl CURVE {what}\n"
        f"#   key pair {name!r}, generated {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
        f'metadata\n    name = "{name}"\n'
        f'curve\n    public-key = "{public}"\n'
    )
    if secret:
        text += f'    secret-key = "{secret}"\n'
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as exc:
        raise CurveError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_allow_list(path: Path) -> frozenset[str]:
    """The public keys listed in ``path`` (see the module docstring for the format)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CurveError(f"cannot read the allow-list {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CurveError(
            f"the allow-list {path} is not UTF-8 text (byte {exc.start}); it lists one Z85 "
            "public key per line: save it as UTF-8"
        ) from None
    keys = set()
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or (words[0].startswith("#") and len(words[0]) != KEY_CHARS):
            continue  # blank, or a comment (a key may itself contain "#")
        key = words[0]
        if not is_curve_key(key):
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
    return _load_certificate(path)[0]


def _load_certificate(path: Path) -> tuple[str, str | None]:
    """The public key and the secret one (None in a public file) of a certificate file;
    CurveError, naming the file, for a file that is none or holds a key ZeroMQ refuses."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveError(f"{path} is not a key file: {exc}") from None
    keys = {"public-key": public.decode(errors="replace")}
    if secret is not None:
        keys["secret-key"] = secret.decode(errors="replace")
    for name, key in keys.items():
        if not is_curve_key(key):
            raise CurveError(
                f"{path}: its {name} {key[:60]!r} is not a key ({KEY_CHARS} Z85 characters); the "
                "file is damaged: make a new pair with gossipdl keys generate DIR"
            )
    secret_key = keys.get("secret-key")
    if (
        secret_key is not None
        and zmq.curve_public(secret_key.encode()).decode() != keys["public-key"]
    ):
        raise CurveError(
            f"{path}: its public-key is not the one its secret-key makes, so no peer that "
            "lists it could connect: make a new pair with gossipdl keys generate DIR"
        )
    return keys["public-key"], secret_key


def load_curve(keys: Path, allow: Path) -> Curve:
    """This peer's key pair from the directory ``keys`` and the allow-list file ``allow``;
    an allow-list that holds our own secret key is refused: that secret was shared."""
    if keys.is_file() and keys.name.endswith(".key_secret"):
        raise CurveError(
            f"--keys {keys} is a key file; give the directory that holds it: --keys {keys.parent}"
        )
    secrets = sorted(keys.glob("*.key_secret")) if keys.is_dir() else []
    if len(secrets) != 1:
        found = "none" if not secrets else ", ".join(p.name for p in secrets)
        raise CurveError(
            f"{keys} must hold exactly one *.key_secret file (found {found}); "
            "make one with: gossipdl keys generate DIR"
        )
    _check_private(secrets[0])
    public, secret = _load_certificate(secrets[0])
    if secret is None:
        raise CurveError(f"{secrets[0]} holds no secret key")
    allowed = read_allow_list(allow)
    if secret in allowed:
        raise CurveError(
            f"the allow-list {allow} holds this peer's SECRET key (from {secrets[0]}): whoever "
            "saw that file can pose as this peer. Make a new pair with gossipdl keys generate "
            "DIR and list only public keys (the .key file's public-key line)"
        )
    return Curve(public, secret, allowed)


def _check_private(path: Path) -> None:
    """Refuse a secret key file that is no regular file (a dangling link, a FIFO, which
    would block the read forever) or that group or others may read or write, as ssh does."""
    try:
        info = path.stat()
    except OSError as exc:
        raise CurveError(f"cannot read the secret key {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CurveError(
            f"{path} is not a regular file; a secret key is one: write a new pair with "
            "gossipdl keys generate DIR"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise CurveError(
            f"{path} has mode {mode:04o}: a secret key must be readable by its owner only "
            f"(anyone who reads it can pose as this peer); fix it with: chmod 600 {path}"
        )
