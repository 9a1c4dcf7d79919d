"""A site's own directory: the secret it generates once, and the keys derived from it.

Everything here stays at the site and is never sent: the server can neither read nor choose it.
A deployed site's directory is, in order,

* node config ``site-dir``, when given;
* the directory of its privacy ledger (node config ``privacy-ledger``), at a site with a policy;
* ``$XDG_STATE_HOME/fedsurv/<digest>`` (``~/.local/state/fedsurv/<digest>``), ``<digest>`` the first
  16 hex digits of the SHA-256 of the data file's absolute path.

A simulated site (one process holds the server and every site) keeps its directory under the run's
``output.dir`` (:func:`simulated_site_dir`): the simulation's operator is every site's operator.

The secret (``site.key``, 32 bytes from the OS's CSPRNG, mode 0600) is created once, atomically
(``O_EXCL``: two processes racing create one). Purpose keys are derived from it with HKDF-SHA256
(:func:`derived_key`), so the split and the state authenticator never share a key. Deleting the
directory makes a new site: a new split, and no state the server holds will be accepted again.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KEY_FILE", "derived_key", "sign", "simulated_site_dir", "site_dir", "site_key", "verify"]

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
        state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        directory = state / "fedsurv" / hashlib.sha256(str(data).encode()).hexdigest()[:16]
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return directory


def simulated_site_dir(output_dir: str | os.PathLike[str], site: str) -> Path:
    """A simulated site's directory: ``<output.dir>/sites/<site>`` (created if missing)."""
    directory = Path(output_dir) / "sites" / site
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return directory


def site_key(directory: Path) -> bytes:
    """The site's secret in ``directory`` (created once from ``os.urandom``; later calls read it)."""
    path = directory / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise ValueError(f"{path}: the site's secret is {len(key)} bytes, not {KEY_BYTES}: the file is damaged; "
                             "restore it from the site's backup (deleting it makes this a new site)") from None
        return key
    key = os.urandom(KEY_BYTES)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
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
