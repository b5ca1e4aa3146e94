"""``gossipdl data fetch NAME``: download a published data set, check it, keep its files.

The download is the user's explicit step (runs never download). CIFAR-10 and CIFAR-100
come from their authors' binary archives, checked against the published MD5 and size
as they stream in (a download longer than the published size stops there), and only the
files the readers need are kept, written to paths of our own (never to a name from the
archive). LEAF publishes scripts, not files: for FEMNIST and Shakespeare the command says
how LEAF's scripts make the JSON files and where to put them.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import http.client
import os
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from gossipdl.data.datasets import DataError
from gossipdl.data.published import CIFAR_RECORDS, cifar_files, data_root

CHUNK = 1 << 20


class FetchError(DataError):
    """A download that failed, was cut short or did not match its published checksum."""


@dataclass(frozen=True)
class Source:
    """Where a data set's archive is published: its ``url``, MD5 and size in bytes, and the
    ``members`` the readers need, each with its size (``(path in the archive, bytes)``;
    the same path is where it is kept, under the data directory)."""

    url: str
    md5: str
    size: int
    members: tuple[tuple[str, int], ...]


def _cifar(name: str, url: str, md5: str, size: int) -> Source:
    """A CIFAR archive: the files its reader reads (:func:`cifar_files`), each of its
    published records (:data:`CIFAR_RECORDS`)."""
    files, record = cifar_files(name)
    sizes = (n * record for n in CIFAR_RECORDS[name])
    return Source(url, md5, size, tuple(zip(files, sizes, strict=True)))


SOURCES = {
    "cifar10": _cifar(
        "cifar10",
        "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
        "c32a1d4ab5d03f1284b67883e8d87530",
        170_052_171,
    ),
    "cifar100": _cifar(
        "cifar100",
        "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
        "03b5dce01913d631647c71ecec9e9cb8",
        168_513_733,
    ),
}

LEAF_FLAGS = {  # LEAF's README settings for the usual "niid, sampled" version
    "femnist": "-s niid --sf 0.05 -k 0 -t sample",
    "shakespeare": "-s niid --sf 0.2 -k 0 -t sample -tf 0.8",
}


def leaf_howto(name: str, data_dir: Path) -> str:
    """How to make LEAF's ``name`` files and where gossipdl reads them."""
    return (
        f"LEAF publishes scripts, not files, so gossipdl cannot check a download of {name}. "
        f"Make it with LEAF's own scripts: git clone https://github.com/TalwalkarLab/leaf && "
        f"cd leaf/data/{name} && ./preprocess.sh {LEAF_FLAGS[name]}; then copy its "
        f"data/train and data/test folders (the *.json files) to {data_dir / name}/train and "
        f"{data_dir / name}/test"
    )


def fetch(
    name: str,
    data_dir: Path | str | None = None,
    source: Source | None = None,
    *,
    progress: bool = True,
    console: Console | None = None,
) -> list[Path]:
    """Download data set ``name`` into ``data_dir`` (:func:`data_root`: ``~`` expanded, the
    default data directory if None) from ``source`` (default: its published one,
    :data:`SOURCES`), check its size and MD5, keep the files the readers need; returns their
    paths. The progress bar goes to ``console`` (default: rich's, on stdout).

    FetchError names what went wrong. Nothing half-written is left, whatever stops it (an
    exception, Ctrl-C): the archive streams into an unnamed temporary file of this process
    alone, checked and extracted from that same open file, and each kept file is written
    under a temporary name of its own, renamed into place only when complete.
    """
    root = data_root(data_dir)
    if name in LEAF_FLAGS:
        raise FetchError(leaf_howto(name, root))
    if source is None:
        if name not in SOURCES:
            known = ", ".join([*SOURCES, *LEAF_FLAGS])
            raise FetchError(f"no data set {name!r} to fetch; known: {known}")
        source = SOURCES[name]
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root, prefix=f".{name}.", suffix=".download") as archive:
            _download(name, source, archive, progress, console)
            archive.seek(0)
            return _extract(name, source, archive, root)
    except OSError as exc:  # the archive's own read errors are FetchErrors by now
        raise _unwritable(name, root, exc) from None


def _unwritable(name: str, root: Path, exc: OSError) -> FetchError:
    """What a failure to write in data directory ``root`` says: where, why, what to do."""
    fix = "name another directory with --data-dir"
    if root.exists() and not root.is_dir():
        cause, fix = "it is not a directory", "name a directory with --data-dir"
    else:
        cause = (exc.strerror or str(exc)) + (f" ({exc.filename})" if exc.filename else "")
    if exc.errno == errno.ENOSPC:
        fix = f"free space there, or {fix}"
    return FetchError(
        f"{name}: cannot write its files in {root}: {cause}; {fix} (nothing half-written was left)"
    )


def _chunks(url: str) -> Iterator[bytes]:
    """The bytes at ``url``, a chunk at a time; FetchError if they cannot be had."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            while chunk := response.read(CHUNK):
                yield chunk
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # HTTPException: not an HTTP server, a body cut short, a bad port; ValueError: a
        # malformed URL (urllib's own refusal)
        reason = " ".join(str(exc).split())  # a server's status line may end in \r\n
        raise FetchError(
            f"download of {url} failed ({type(exc).__name__}: {reason}); check that the URL "
            "(--url) serves the archive over http(s), or try again later"
        ) from None


def _download(
    name: str, source: Source, archive: IO[bytes], progress: bool, console: Console | None
) -> None:
    """Stream ``source`` into ``archive``, checking size and MD5 on the way."""
    if not source.url.startswith(("https://", "http://")):
        raise FetchError(f"{name}: {source.url!r} is not an http(s) URL")
    digest, got = hashlib.md5(usedforsecurity=False), 0
    columns = (TextColumn(f"{name}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task(name, total=source.size)
        for chunk in _chunks(source.url):
            got += len(chunk)
            if got > source.size:
                raise FetchError(
                    f"{name}: {source.url} sent more than the published {source.size:,} bytes; "
                    "stopped (a wrong or changed file)"
                )
            digest.update(chunk)
            archive.write(chunk)
            bar.update(task, advance=len(chunk))
    if got != source.size or digest.hexdigest() != source.md5:
        raise FetchError(
            f"{name}: {source.url} gave {got:,} bytes with MD5 {digest.hexdigest()}, not the "
            f"published {source.size:,} bytes with MD5 {source.md5}; nothing was kept (try "
            "again; a proxy or mirror may have changed it)"
        )


_NOT_THE_ARCHIVE = (tarfile.TarError, KeyError, EOFError, zlib.error, gzip.BadGzipFile)
"""What reading an archive that is not what was published raises (BadGzipFile is an OSError,
caught before the write errors are)."""


def _extract(name: str, source: Source, archive: IO[bytes], data_dir: Path) -> list[Path]:
    """Copy the archive's needed regular files, each of its expected size, to our paths."""
    kept = []
    try:
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            for member_name, size in source.members:
                member = tar.getmember(member_name)
                if not member.isfile() or member.size != size:
                    raise FetchError(f"{name}: {member_name} in the archive is not {size:,} bytes")
                reader = tar.extractfile(member)
                assert reader is not None  # a regular file's
                target = data_dir / member_name  # our constant path, not the archive's word
                with reader:
                    _keep(reader, target)
                kept.append(target)
    except _NOT_THE_ARCHIVE as exc:
        raise FetchError(f"{name}: the archive is not what was published ({exc})") from None
    return kept


def _keep(reader: IO[bytes], target: Path) -> None:
    """Write ``reader``'s bytes to ``target`` through a temporary file of this process beside
    it, renamed into place when complete and removed on any failure or interruption."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            while block := reader.read(CHUNK):
                out.write(block)
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
