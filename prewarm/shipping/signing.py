"""Ed25519 signatures over a bundle's exact index bytes (the index pins every object by sha256).

Keys: ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (SubjectPublicKeyInfo PEM), made by
``prewarm keygen``. A signature file is JSON ``{"alg": "ed25519", "key_id": ..., "public_key": base64,
"signature": base64}``; ``key_id`` is the first 16 hex chars of the sha256 of the raw public key, so a node trusting
several keys names the one that signed; ``public_key`` (the raw 32 bytes) lets a node without a trusted key still
check that a signature is one: made over these very index bytes by the key it names (:func:`self_check`). That
proves no signer is trusted (anyone can sign with a key of their own: only ``--trust`` says whose), but a stale
signature (over another index) or a forged one never passes in any mode. A signature of prewarm before
``public_key`` (no such field) can be checked only against a trusted key.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .bundle import MAX_SIGNATURE_BYTES, open_regular, read_bounded
from .cachedir import write_atomic
from ..errors import EnvironmentProblem, IntegrityError, SignatureError


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def keygen(name: str | os.PathLike, *, force: bool = False) -> tuple[Path, Path, str]:
    """Write ``<name>.key`` and ``<name>.pub``; returns (private path, public path, key id)."""
    priv_path, pub_path = Path(f"{name}.key"), Path(f"{name}.pub")
    if not force and (priv_path.exists() or pub_path.exists()):
        raise EnvironmentProblem(f"{priv_path} or {pub_path} already exists (pass --force to replace it)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    written: list[Path] = []
    try:
        priv_path.parent.mkdir(parents=True, exist_ok=True)
        for path, data, mode in ((priv_path, pem, 0o600), (pub_path, pub, 0o644)):
            write_atomic(path, data, mode=mode)
            written.append(path)
    except OSError as e:  # a full or read-only disk: no temp file and no half key pair is left behind
        for path in written:
            path.unlink(missing_ok=True)
        raise EnvironmentProblem(f"{e.filename or priv_path}: {e.strerror} (writing the key pair)") from None
    return priv_path, pub_path, key_id(key.public_key())


def _load(path: str | os.PathLike, private: bool):
    try:
        data = read_bounded(open_regular(path), 64 << 10, str(path))
    except OSError as e:
        raise SignatureError(f"{path}: cannot read key ({e.strerror})") from None
    except IntegrityError as e:  # not a regular file, or far too large for a PEM key
        raise SignatureError(f"{e} (expected a PEM key)") from None
    try:
        key = (
            serialization.load_pem_private_key(data, password=None)
            if private
            else serialization.load_pem_public_key(data)
        )
    except (ValueError, TypeError) as e:
        raise SignatureError(f"{path}: not a PEM Ed25519 {'private' if private else 'public'} key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise SignatureError(f"{path}: not an Ed25519 key ({type(key).__name__})")
    return key


def sign(data: bytes, private_key: str | os.PathLike) -> bytes:
    key: Ed25519PrivateKey = _load(private_key, private=True)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    doc = {"alg": "ed25519", "key_id": key_id(key.public_key()), "public_key": base64.b64encode(raw).decode(),
           "signature": base64.b64encode(key.sign(data)).decode()}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()




def load_trusted(paths: list[str | os.PathLike]) -> dict[str, Ed25519PublicKey]:
    """The trusted public keys, by key id."""
    return {key_id(k): k for k in (_load(p, private=False) for p in paths)}


def _parse(signature: bytes, where: str) -> tuple[str, bytes, Ed25519PublicKey | None]:
    """(the key id a signature names, its signature bytes, the public key it carries or None); SignatureError when
    it is malformed, or carries a public key that is not the one its key id names."""
    try:
        doc = json.loads(signature)
        sig = base64.b64decode(doc["signature"], validate=True)
        assert doc.get("alg") == "ed25519"
    except Exception:
        raise SignatureError(f"{where}: index.json.sig is malformed (expected prewarm's ed25519 JSON)") from None
    if not isinstance(doc.get("key_id"), str):
        raise SignatureError(f"{where}: index.json.sig names no key id (key_id {doc.get('key_id')!r})")
    public = None
    if "public_key" in doc:
        try:
            public = Ed25519PublicKey.from_public_bytes(base64.b64decode(doc["public_key"], validate=True))
        except Exception:
            raise SignatureError(f"{where}: index.json.sig carries a malformed public_key") from None
        if key_id(public) != doc["key_id"]:
            raise SignatureError(f"{where}: index.json.sig names key {doc['key_id']!r} but carries key "
                                 f"{key_id(public)!r}: forged or corrupted")
    return doc["key_id"], sig, public


def signer(data: bytes, signature: bytes, keys: dict[str, Ed25519PublicKey], where: str) -> tuple[str, bool]:
    """(the key id the signature names, whether that key is among ``keys`` and signed ``data``); SignatureError when
    the signature is malformed, or names a trusted key and does not verify, or carries its key and does not verify
    under it."""
    named, sig, public = _parse(signature, where)
    key = keys.get(named)
    if key is None:
        if public is not None:
            _check(public, sig, data, named, where)
        return named, False
    _check(key, sig, data, named, where)
    return named, True


def _check(key: Ed25519PublicKey, sig: bytes, data: bytes, named: str, where: str) -> None:
    try:
        key.verify(sig, data)
    except InvalidSignature:
        raise SignatureError(f"{where}: the signature of index.json does not verify under key {named} (a stale "
                             f"signature over another index, a tampered index or signature)") from None


def self_check(data: bytes, signature: bytes, where: str) -> str:
    """What a node without a trusted key checks of a present signature: well-formed, carrying the public key its key
    id names, and made over ``data`` by that key; returns the key id. SignatureError otherwise (a signature of
    prewarm before ``public_key`` cannot be checked without the key: refused, naming --trust)."""
    named, sig, public = _parse(signature, where)
    if public is None:
        raise SignatureError(f"{where}: index.json.sig (key {named}) carries no public key, so it cannot be checked "
                             f"without a trusted key: pass --trust with that key's .pub, or re-pack the bundle with "
                             f"--sign (a present signature is never ignored)")
    _check(public, sig, data, named, where)
    return named


def verify(data: bytes, signature: bytes | None, trusted: list[str | os.PathLike], where: str) -> str:
    """The key id of the trusted key that signed ``data``; SignatureError naming why otherwise."""
    if signature is None:
        raise SignatureError(f"{where}: no signature (index.json.sig), but one is required (trusted keys given)")
    if not trusted:
        raise SignatureError(f"{where}: a signature is required but no trusted public key was given (--trust)")
    keys = load_trusted(trusted)
    named, ok = signer(data, signature, keys, where)
    if not ok:
        raise SignatureError(
            f"{where}: signed by key {named!r}, which is not among the trusted keys ({', '.join(keys)})")
    return named
