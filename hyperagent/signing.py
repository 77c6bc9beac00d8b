"""Ed25519 keys for settings messages: the coordinator's private key, the nodes' trusted set.

Only the coordinator holds a private key; agents hold public keys, each named by its key id
(the first 16 hex digits of the SHA-256 of the raw 32-byte public key). A signature names the
key that made it, so during a rotation an agent that trusts the old and the new key takes
settings signed by either. Key files are PEM (PKCS#8 private, SubjectPublicKeyInfo public), as
``hyperagent keys generate`` writes them and ``openssl genpkey -algorithm ed25519`` does.
"""

from __future__ import annotations

import grp
import hashlib
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hyperagent.errors import HyperagentError

PUBLIC_SUFFIX = ".pub"
"""In a trusted-keys directory, the files read as public keys (others are ignored)."""


class KeyFileError(HyperagentError):
    """A key file is missing, unreadable, too open, or not the kind of key expected."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def key_id(public: Ed25519PublicKey) -> str:
    """The key's id: the first 16 hex digits of the SHA-256 of its raw 32 bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    """The coordinator's private key and its id."""

    private: Ed25519PrivateKey
    key_id: str

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh key (the embedded demo's, and the one ``keys generate`` writes)."""
        return cls.of(Ed25519PrivateKey.generate())

    @classmethod
    def of(cls, private: Ed25519PrivateKey) -> SigningKey:
        return cls(private, key_id(private.public_key()))

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def trusted(self) -> TrustedKeys:
        """A trusted set holding this key's public half only."""
        return TrustedKeys([self.public])

    def __repr__(self) -> str:
        return f"SigningKey({self.key_id})"


class TrustedKeys:
    """Public keys by key id: ``keys`` given as they are, and those read from ``paths``
    (files, or directories of ``*.pub`` files). The paths are read again when they change
    (``refresh``), so a key added to or removed from a node during a rotation counts without
    restarting its agent."""

    def __init__(self, keys: Iterable[Ed25519PublicKey] = (), paths: Sequence[Path] = ()) -> None:
        self.fixed = _by_id(keys)
        self.paths = tuple(paths)
        self._seen = _fingerprint(self.paths) if self.paths else None
        self._reading = threading.Lock()
        self.keys = {**self.fixed, **_by_id(_read_public_keys(self.paths))}

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self.keys.get(kid)

    @property
    def ids(self) -> list[str]:
        return sorted(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, kid: object) -> bool:
        return kid in self.keys

    def with_key(self, key: Ed25519PublicKey) -> TrustedKeys:
        """This set and ``key`` (the paths read again)."""
        return TrustedKeys([*self.fixed.values(), key], self.paths)

    def refresh(self) -> bool:
        """Read the paths again if a file or directory among them changed since they were
        read (a few ``stat`` calls otherwise); True when the set changed. A file that cannot
        be read now keeps the set as it was (lenient at run time). Blocking: call it in a
        thread: calls at once take turns, so none answers from the old set while another reads
        the new one."""
        if not self.paths:
            return False
        with self._reading:
            seen = _fingerprint(self.paths)
            if seen == self._seen:
                return False
            self._seen = seen
            try:
                keys = {**self.fixed, **_by_id(_read_public_keys(self.paths))}
            except KeyFileError:
                return False
            changed = keys.keys() != self.keys.keys()
            self.keys = keys
            return changed

    def describe(self) -> str:
        return ", ".join(self.ids) if self.keys else "none"


def _by_id(keys: Iterable[Ed25519PublicKey]) -> dict[str, Ed25519PublicKey]:
    return {key_id(k): k for k in keys}


def _fingerprint(paths: Sequence[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        for p in [path, *(sorted(path.glob(f"*{PUBLIC_SUFFIX}")) if path.is_dir() else [])]:
            try:
                s = p.stat()
                out.append((s.st_ino, s.st_mtime_ns, s.st_size))
            except OSError:
                out.append(None)
    return tuple(out)


def _read(path: Path) -> tuple[bytes, int]:
    """The file's bytes and permission bits."""
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise KeyFileError(path, "is a directory, not a key file")
        return path.read_bytes(), info.st_mode & 0o777
    except OSError as e:
        raise KeyFileError(path, e.strerror or str(e)) from e


def load_signing_key(path: Path) -> SigningKey:
    """The Ed25519 private key in ``path`` (PEM), which other users may not read; raises
    KeyFileError saying what is wrong."""
    data, mode = _read(path)
    if b"PUBLIC KEY" in data and b"PRIVATE KEY" not in data:
        raise KeyFileError(
            path, "holds a public key; the coordinator signs with the private key (*.key)"
        )
    if mode & 0o007:
        raise KeyFileError(
            path,
            f"private key accessible to other users (mode {mode:o}); make it 0600, or 0640 "
            "root:hyperagent-signing",
        )
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise KeyFileError(path, f"not a PEM private key without passphrase ({e})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(path, "not an Ed25519 key")
    return SigningKey.of(private)


def load_public_key(path: Path) -> Ed25519PublicKey:
    """The Ed25519 public key in ``path`` (PEM), which other users may not write; a private key
    there is refused, since a file a node trusts must never hold what signs."""
    data, mode = _read(path)
    if b"PRIVATE KEY" in data:
        raise KeyFileError(
            path,
            "holds a private key: a node must hold only the public key (*.pub); remove this "
            "file from the node and make a new key pair",
        )
    if mode & 0o022:
        raise KeyFileError(
            path,
            f"trusted key writable by other users (mode {mode:o}): whoever can write it can "
            "sign settings every node applies; make it 0644 root:root",
        )
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise KeyFileError(path, f"not a PEM public key ({e})") from None
    if not isinstance(public, Ed25519PublicKey):
        raise KeyFileError(path, "not an Ed25519 key")
    return public


def _read_public_keys(paths: Sequence[Path]) -> list[Ed25519PublicKey]:
    keys = []
    for path in paths:
        if path.is_dir():
            try:
                writable = path.stat().st_mode & 0o022
            except OSError as e:
                raise KeyFileError(path, e.strerror or str(e)) from e
            if writable:
                raise KeyFileError(
                    path,
                    "trusted-keys directory writable by other users: whoever can add a file "
                    "there can sign settings every node applies; make it 0755 root:root",
                )
            if not os.access(path, os.R_OK | os.X_OK):
                raise KeyFileError(path, "this user may not list the directory")
            keys += [load_public_key(p) for p in sorted(path.glob(f"*{PUBLIC_SUFFIX}"))]
        else:
            keys.append(load_public_key(path))
    return keys


def public_key_of(path: Path) -> tuple[Ed25519PublicKey, bool]:
    """The public key of a key file of either kind, and whether the file holds the private
    key: what ``hyperagent keys id`` prints."""
    data, _ = _read(path)
    try:
        if b"PRIVATE KEY" in data:
            private = serialization.load_pem_private_key(data, password=None)
            if isinstance(private, Ed25519PrivateKey):
                return private.public_key(), True
        else:
            public = serialization.load_pem_public_key(data)
            if isinstance(public, Ed25519PublicKey):
                return public, False
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise KeyFileError(path, f"not a PEM key ({e})") from None
    raise KeyFileError(path, "not an Ed25519 key")


def write_key_pair(out: Path, name: str, group: str | None = None) -> tuple[SigningKey, Path, Path]:
    """A new key pair as ``out/name.key`` (private, mode 0600; with ``group``: 0640 and that
    group) and ``out/name.pub`` (public, 0644); never overwrites a file."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(out / name, "the key's name must be a plain file name")
    gid = -1
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise KeyFileError(out, f"no group {group!r} (systemd-sysusers creates it)") from None
    key = SigningKey.generate()
    private_path, public_path = out / f"{name}.key", out / f"{name}{PUBLIC_SUFFIX}"
    private = key.private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public = key.public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
        for path in (private_path, public_path):
            if path.exists():
                raise KeyFileError(path, "exists; give another --name (a rotation keeps both)")
        _write(private_path, private, 0o640 if group else 0o600, gid)
        _write(public_path, public, 0o644, -1)
    except OSError as e:
        raise KeyFileError(out, e.strerror or str(e)) from e
    return key, private_path, public_path


def _write(path: Path, data: bytes, mode: int, gid: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if gid != -1:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_signature(public: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        public.verify(signature, data)
    except InvalidSignature:
        return False
    return True
