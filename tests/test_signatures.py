"""A signature that is present and does not verify is refused in every mode (issue 57). Without --trust a node has
no key to trust, but a present ``index.json.sig`` must still be one: well-formed, carrying the public key its key id
names, and made over these very index bytes by that key. A stale signature (another index's), one forged under
another key, one whose key is not the key it names, or one that cannot be checked (prewarm's older format, no
public key) is refused (exit 7) before anything is written; a good one installs, proving nothing about who signed it
(only --trust does).
"""
from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest

from prewarm.errors import SignatureError
from prewarm.shipping.bundle import INDEX, SIGNATURE
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.signing import keygen, sign

from prewarm_helpers import run_cli, synthetic_cache


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("signatures")
    keygen(root / "signer")
    keygen(root / "stranger")
    for name, seed in (("a", 1), ("b", 2)):
        pack(synthetic_cache(root / f"{name}-build", 2, seed=seed, scale=0.01), root / name,
             signing_key=root / "signer.key")
    return {"root": root, "a": root / "a", "b": root / "b"}


def with_signature(world, tmp_path: Path, make) -> Path:
    """A copy of bundle a whose signature is ``make(index bytes, a's signature document)``."""
    bundle = shutil.copytree(world["a"], tmp_path / "bundle")
    doc = json.loads((bundle / SIGNATURE).read_bytes())
    (bundle / SIGNATURE).write_bytes(make((bundle / INDEX).read_bytes(), doc))
    return bundle


def stale(world):
    return lambda data, doc: (world["b"] / SIGNATURE).read_bytes()  # the same key's signature of another index


def by_stranger_as_signer(world):
    def make(data: bytes, doc: dict) -> bytes:  # the stranger's signature, under the signer's key id and key
        forged = json.loads(sign(data, world["root"] / "stranger.key"))
        return json.dumps({**forged, "key_id": doc["key_id"], "public_key": doc["public_key"]}).encode()
    return make


def key_not_named(world):
    def make(data: bytes, doc: dict) -> bytes:  # a valid signature by the stranger, naming the signer's key id
        return json.dumps({**json.loads(sign(data, world["root"] / "stranger.key")), "key_id": doc["key_id"]}).encode()
    return make


BAD = {
    "stale": (stale, "does not verify"),
    "another key's signature": (by_stranger_as_signer, "does not verify"),
    "a key other than the one named": (key_not_named, "but carries key"),
    "malformed": (lambda world: lambda data, doc: b"{not json", "malformed"),
    "a malformed public key": (lambda world: lambda data, doc: json.dumps({**doc, "public_key": "AAAA"}).encode(),
                               "malformed public_key"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_present_signature_that_does_not_verify_is_refused_without_trust(world, tmp_path, case):
    make, words = BAD[case]
    bundle = with_signature(world, tmp_path, make(world))
    node = tmp_path / "node"
    with pytest.raises(SignatureError, match=f"{re.escape(str(bundle / INDEX))}: .*{words}"):
        install(str(bundle), node)  # exit 7 (the command line's: the next test)
    assert not node.exists()  # refused before anything was written


def test_a_signature_of_the_older_format_is_checked_only_against_a_trusted_key(world, tmp_path):
    def older(data: bytes, doc: dict) -> bytes:
        return json.dumps({k: v for k, v in doc.items() if k != "public_key"}).encode()

    bundle = with_signature(world, tmp_path, older)
    p = run_cli("install", bundle, "--cache-dir", tmp_path / "node", check=SignatureError.exit_code)
    assert "carries no public key" in p.stderr and "--trust" in p.stderr and not (tmp_path / "node").exists()
    r = install(str(bundle), tmp_path / "node", trusted_keys=[str(world["root"] / "signer.pub")], durable=False)
    assert r.signed_by and r.installed == 2


def test_a_good_signature_installs_without_trust_and_proves_no_signer(world, tmp_path):
    """Self-consistent signatures, the signer's and a stranger's: both install without --trust (no key is trusted,
    none is kept as proof); with --trust only the trusted key's does."""
    r = install(str(world["a"]), tmp_path / "node", durable=False)
    assert (r.installed, r.signed_by) == (2, None) and not list((tmp_path / "node").rglob("*.sig"))
    stranger = with_signature(world, tmp_path, lambda data, doc: sign(data, world["root"] / "stranger.key"))
    assert install(str(stranger), tmp_path / "other", durable=False).installed == 2
    with pytest.raises(SignatureError, match="not among the trusted keys"):
        install(str(stranger), tmp_path / "third", trusted_keys=[str(world["root"] / "signer.pub")], durable=False)
    assert base64.b64decode(json.loads((world["a"] / SIGNATURE).read_bytes())["public_key"])  # pack writes it
