"""A site's own directory: the secret it generates once, and the keys derived from it.

Everything here stays at the site and is never sent: the server can neither read nor choose it.
A deployed site's directory is, in order,

* node config ``site-dir``, when given;
* the directory of its privacy ledger (node config ``privacy-ledger``), at a site with a policy;
* ``$XDG_STATE_HOME/fedsurv/<digest>`` (``~/.local/state/fedsurv/<digest>``), ``<digest>`` the first
  16 hex digits of the SHA-256 of the data file's absolute path.

A simulated site has no directory: the simulation's operator runs the server and every site.

The secret (``site.key``, 32 bytes from the OS's CSPRNG, mode 0600) is created once, atomically
(``O_EXCL``: two processes racing create one). Purpose keys are derived from it with HKDF-SHA256
(:func:`derived_key`), so the split and the state authenticator never share a key. Deleting the
directory makes a new site: a new split, and no state the server holds will be accepted again.

A site's privacy ledger (JSON Lines) is hash-chained: each line carries ``"prev"``, the SHA-256 of the
previous line's exact bytes (newline included; the first line: 64 zeros), and the site keeps the
ledger's head (its line count and its last line's hash) in its directory, ``<ledger name>.head``
(:func:`ledger_head`), replaced atomically after each synced append. :func:`open_ledger` checks
the two agree at every read and raises :class:`LedgerTampered` when lines were removed or edited,
or either file is missing while the other holds a budget; it repairs only what a crash leaves (a
half-written last line, or a last line whose head was not yet written).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["GENESIS", "KEY_FILE", "Head", "LedgerState", "LedgerTampered", "SiteLedger", "check_ledger",
           "derived_key", "ledger_head", "line_hash", "open_ledger", "read_head", "read_verified", "sign",
           "site_dir", "site_key", "verify", "write_head"]

#: The site's secret, in its directory.
KEY_FILE = "site.key"
KEY_BYTES = 32


def site_dir(node_config: Mapping[str, Any]) -> Path:
    """A deployed site's own directory (see the module's docstring for the order); created if missing."""
    if "site-dir" in node_config:
        directory = Path(str(node_config["site-dir"])).expanduser()
    elif "privacy-ledger" in node_config:
        directory = Path(str(node_config["privacy-ledger"])).expanduser().resolve().parent
    else:
        if "data-path" not in node_config:
            raise ValueError("node config has neither 'site-dir' nor 'data-path': a deployed site keeps its secret "
                             "in its own directory, e.g. --node-config \"site-dir='/var/fedsurv/site'\"")
        data = Path(str(node_config["data-path"])).expanduser().resolve()
        directory = _state_home() / "fedsurv" / hashlib.sha256(str(data).encode()).hexdigest()[:16]
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return directory


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")


def site_key(directory: Path) -> bytes:
    """The site's secret in ``directory``: created once from ``os.urandom`` (written whole to a temporary file, synced,
    then hard-linked into place, which fails if another process got there first: no process ever reads a partly
    written key); later calls read it. ``ValueError`` naming the file when it is not a key."""
    path = directory / KEY_FILE
    if not path.exists():
        fd, temporary = tempfile.mkstemp(prefix=f".{KEY_FILE}.", dir=directory)
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another process linked its key first: that one is the key
                os.link(temporary, path)
        finally:
            os.unlink(temporary)
        _fsync_directory(directory)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path}: the site's secret is {len(key)} bytes, not {KEY_BYTES}: the file is damaged; "
                         "restore it from the site's backup (deleting it makes this a new site)")
    return key


def derived_key(directory: Path, purpose: str) -> bytes:
    """A 32-byte key for one ``purpose`` (``"split"``, ``"state"``, …), derived from the site's secret by HKDF-SHA256."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=f"fedsurv/{purpose}".encode()).derive(site_key(directory))


def sign(key: bytes, payload: bytes) -> str:
    """HMAC-SHA256 of ``payload`` under ``key``, as hex."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def verify(key: bytes, payload: bytes, tag: object) -> bool:
    """Whether ``tag`` is :func:`sign`'s tag of ``payload`` under ``key`` (compared in constant time)."""
    return isinstance(tag, str) and hmac.compare_digest(sign(key, payload), tag)


# ------------------------------------------------------------------ a hash-chained ledger and its head

#: The hash the first line of a ledger chains to.
GENESIS = "0" * 64


class LedgerTampered(ValueError):
    """A site's ledger does not match its head (lines removed or edited, or one file missing): the site releases
    nothing until an operator restores the ledger or knowingly starts a new one."""


@dataclass(frozen=True)
class Head:
    """A ledger's head: how many lines it has and the SHA-256 of its last line (:data:`GENESIS` when none)."""

    lines: int = 0
    sha256: str = GENESIS


@dataclass(frozen=True)
class LedgerState:
    """A verified ledger: its complete lines (parsed), their bytes and head; ``ahead``: one line more than the head
    file records (a crash before the head was written); ``torn``: bytes of a half-written last line after them."""

    records: list[dict[str, Any]]
    size: int
    head: Head
    ahead: bool = False
    torn: int = 0


def ledger_head(node_config: Mapping[str, Any], ledger: str | os.PathLike[str]) -> Path:
    """Where the site keeps the head of its ledger file ``ledger``: ``<site dir>/<ledger name>.head``."""
    return site_dir(node_config) / f"{Path(ledger).name}.head"


def line_hash(raw: bytes) -> str:
    """The SHA-256 (hex) of a ledger line's exact bytes, its newline included."""
    return hashlib.sha256(raw).hexdigest()


def _tampered(ledger: Path, head_file: Path, why: str) -> LedgerTampered:
    return LedgerTampered(
        f"privacy ledger {ledger} does not match its head {head_file}: {why}; this site releases nothing until an "
        f"operator acts: restore the ledger from the site's backup, or, to knowingly start a new budget for this data "
        f"set, remove both {ledger} and {head_file} (a new site)")


def read_head(ledger: Path, head_file: Path) -> Head | None:
    """The head ``head_file`` records (``None`` when there is none); :class:`LedgerTampered` when it is damaged."""
    try:
        data = json.loads(head_file.read_bytes())
        head = Head(data["lines"], data["sha256"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise _tampered(ledger, head_file, "the head file is damaged") from None
    if not (isinstance(head.lines, int) and head.lines >= 1 and isinstance(head.sha256, str)
            and len(head.sha256) == 64):
        raise _tampered(ledger, head_file, "the head file is damaged")
    return head


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_head(head_file: Path, head: Head) -> None:
    """Replace ``head_file`` with ``head`` atomically: a synced temporary file renamed over it, then the directory
    synced (a crash leaves the old head or the new one)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{head_file.name}.", suffix=".tmp", dir=head_file.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write((json.dumps({"lines": head.lines, "sha256": head.sha256}) + "\n").encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, head_file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(head_file.parent)


def _chain(ledger: Path, head_file: Path, complete: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """The complete lines of a ledger, parsed, and each line's hash; :class:`LedgerTampered` at a line that is not
    JSON or does not chain to the one before it."""
    records, hashes, prev = [], [], GENESIS
    for number, body in enumerate(complete.split(b"\n") if complete else [], start=1):
        try:
            record = json.loads(body)
        except ValueError:
            raise _tampered(ledger, head_file, f"line {number} is not JSON") from None
        if not isinstance(record, dict) or record.get("prev") != prev:
            raise _tampered(ledger, head_file, f"line {number} does not chain to the line before it (a line was "
                                               "edited, removed or inserted)")
        records.append(record)
        prev = line_hash(body + b"\n")
        hashes.append(prev)
    return records, hashes


def check_ledger(ledger: Path, head_file: Path, data: bytes | None) -> LedgerState:
    """Verify the ledger's bytes ``data`` (``None``: the file is missing) against its head file: they agree, or the
    ledger has one complete line more (``ahead``), or a half-written last line after lines that agree (``torn``);
    :class:`LedgerTampered` for anything else. Reads the head file; writes nothing."""
    head = read_head(ledger, head_file)
    if data is None:
        if head is not None:
            raise _tampered(ledger, head_file, f"the ledger is missing, its head records {head.lines} lines")
        return LedgerState([], 0, Head())
    body, newline, torn = data.rpartition(b"\n")
    records, hashes = _chain(ledger, head_file, body)
    count, size = len(records), len(body) + len(newline)
    known = head or Head()
    if head is None and count > 1:
        raise _tampered(ledger, head_file, f"the head file is missing, the ledger has {count} lines")
    if count < known.lines:
        raise _tampered(ledger, head_file, f"the ledger has {count} lines, its head records {known.lines} (lines were "
                                           "removed)")
    if known.lines and hashes[known.lines - 1] != known.sha256:
        raise _tampered(ledger, head_file, f"line {known.lines} is not the line its head records (it was edited)")
    if count > known.lines + 1 or (count == known.lines + 1 and torn):
        raise _tampered(ledger, head_file, f"the ledger has {count} lines, its head records {known.lines} (lines were "
                                           "added)")
    return LedgerState(records, size, Head(count, hashes[-1] if hashes else GENESIS), count > known.lines, len(torn))


class SiteLedger:
    """A site's ledger file, open under an exclusive lock and verified against its head (:func:`open_ledger`):
    ``records``, its lines; :meth:`append` adds one."""

    def __init__(self, fd: int, path: Path, head_file: Path, state: LedgerState) -> None:
        self.path, self.head_file, self._fd = path, head_file, fd
        self.records = list(state.records)
        self.head = state.head

    def append(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as a line chained to the last (``"prev"`` first), sync it, then replace the head."""
        line = {"prev": "", **record}
        line["prev"] = self.head.sha256
        raw = (json.dumps(line) + "\n").encode()
        view = memoryview(raw)
        while view:
            view = view[os.write(self._fd, view):]
        os.fsync(self._fd)
        if not self.head.lines:  # a new file: its name must outlive a crash before the head names its line
            _fsync_directory(self.path.parent)
        head = Head(self.head.lines + 1, line_hash(raw))
        write_head(self.head_file, head)
        self.records.append(json.loads(raw))
        self.head = head


def _settle(fd: int, ledger: Path, head_file: Path, state: LedgerState) -> None:
    """Repair what a crash leaves: truncate a half-written last line; write the head of a line written without it."""
    if state.torn:
        os.ftruncate(fd, state.size)
        os.fsync(fd)
        print(f"{ledger}: repaired: removed a half-written last line ({state.torn} bytes, a crash mid-append)",
              file=sys.stderr, flush=True)
    if state.ahead:
        write_head(head_file, state.head)
        print(f"{ledger}: its last line was written but not its head {head_file} (a crash between the two): head "
              "updated", file=sys.stderr, flush=True)


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def open_ledger(path: Path, head_file: Path) -> Iterator[SiteLedger]:
    """The ledger file ``path`` under an exclusive lock, verified against ``head_file`` (:func:`check_ledger`) and
    repaired where a crash left it; created (empty) only when neither file exists. :class:`LedgerTampered` before
    anything is written when they disagree."""
    create = 0 if head_file.exists() else os.O_CREAT
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | create, 0o666)
    except FileNotFoundError:
        check_ledger(path, head_file, None)  # raises: the head exists
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink == 0:  # removed while this process waited for the lock
            raise _tampered(path, head_file, "the ledger was removed while in use")
        state = check_ledger(path, head_file, _read_all(fd))
        _settle(fd, path, head_file, state)
        yield SiteLedger(fd, path, head_file, state)
    finally:
        os.close(fd)  # releases the lock


def read_verified(path: Path, head_file: Path) -> LedgerState:
    """The ledger file ``path`` verified against ``head_file`` under a shared lock, changing nothing (what a crash
    left is reported in ``ahead`` and ``torn``, repaired at the next :func:`open_ledger`); ``FileNotFoundError`` when
    neither file exists."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        check_ledger(path, head_file, None)  # raises when the head exists
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return check_ledger(path, head_file, _read_all(fd))
    finally:
        os.close(fd)
