"""OCI registries as stores, against the reference registry (distribution) on loopback, through the CLI where a
user would be: push to two repositories, dedup across tags, install, pinned digests, tampering, a registry that
goes away mid-push, 16 concurrent installs, and `oras pull` of what prewarm pushed."""
from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import os
import shutil
from pathlib import Path

import bcrypt
import oras.client
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from prewarm.shipping.bundle import INDEX, OBJECTS
from prewarm.shipping.cachedir import META
from prewarm.errors import IntegrityError, StoreError
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.stores import push
from prewarm.shipping.stores.oci import (ARTIFACT_TYPE, INDEX_MEDIA_TYPE, OBJECT_MEDIA_TYPE, SIGNATURE_MEDIA_TYPE, OciStore,
                                 open_oci)
from prewarm.node.verify import verify

from prewarm_helpers import concurrent_installs, copy_cache, run_cli

INSECURE = {"insecure": True}  # the test registry speaks plain HTTP on loopback


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def blob_uploads(registry) -> list[str]:
    """Digests of the blobs the registry accepted an upload of (its own log: the PUT that completes an upload)."""
    return [uri.split("digest=", 1)[1].split("&")[0].replace("%3A", ":")
            for method, uri, status in registry.requests()
            if method == "PUT" and "/blobs/uploads/" in uri and status == 201]


def manifest_of(registry, ref: str) -> tuple[dict, str, str]:
    """The registry's manifest for REPO:TAG / REPO@DIGEST: (document, content type, digest), read without prewarm."""
    repo, _, tag = ref.rpartition(":") if "@" not in ref else ref.partition("@")
    r = requests.get(f"http://127.0.0.1:{registry.port}/v2/{repo}/manifests/{tag}",
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    r.raise_for_status()
    return r.json(), r.headers["Content-Type"], r.headers["Docker-Content-Digest"]


@pytest.fixture
def signed_bundle(triton_cache, tmp_path) -> tuple[Path, Path]:
    run_cli("keygen", "-o", tmp_path / "signer")
    run_cli("pack", triton_cache, "-o", tmp_path / "bundle", "--sign", tmp_path / "signer.key")
    return tmp_path / "bundle", tmp_path / "signer.pub"


def test_push_to_two_repos_install_verify_and_oras_pull_gets_the_bundle(signed_bundle, registry, tmp_path):
    bundle, pub = signed_bundle
    n = len(list((bundle / OBJECTS).iterdir()))
    urls = [registry.url("team-a/kimi:v1"), registry.url("team.b/kimi:v1")]  # "team.b": a dot, still no host
    first = json.loads(run_cli("push", bundle, *urls, "--insecure", "--json").stdout)
    assert first["ok"] and [t["sent"] for t in first["targets"]] == [n, n]

    node = tmp_path / "node"
    res = json.loads(run_cli("install", urls[1], "--cache-dir", node, "--insecure", "--trust", pub,
                             "--require-signature", "--json").stdout)
    assert res["installed"] == n and res["signed_by"]
    assert verify(node).ok
    report = json.loads(run_cli("verify", "--cache-dir", node, "--bundle", urls[0], "--insecure", "--trust", pub,
                                "--require-signature", "--json").stdout)
    assert report["ok"] and report["entries_ok"] == n

    # a valid OCI image manifest of our artifact type, read straight from the registry
    doc, content_type, digest = manifest_of(registry, "team-a/kimi:v1")
    assert content_type == "application/vnd.oci.image.manifest.v1+json" and doc["schemaVersion"] == 2
    assert doc["artifactType"] == ARTIFACT_TYPE and doc["config"]["mediaType"] == INDEX_MEDIA_TYPE
    index_bytes = (bundle / INDEX).read_bytes()
    assert doc["config"]["digest"] == "sha256:" + hashlib.sha256(index_bytes).hexdigest()
    assert sorted(layer["mediaType"] for layer in doc["layers"]) == sorted(
        [OBJECT_MEDIA_TYPE] * n + [INDEX_MEDIA_TYPE, SIGNATURE_MEDIA_TYPE])
    assert doc["annotations"]["dev.prewarm.entries"] == str(n)
    assert "triton.version=" in doc["annotations"]["dev.prewarm.fingerprint"]
    assert manifest_of(registry, "team.b/kimi:v1")[2] == digest  # same bundle, same manifest, any repository

    # oras's own client pulls exactly the bundle directory, which installs like any bundle dir
    pulled = tmp_path / "pulled"
    client = oras.client.OrasClient(hostname=f"127.0.0.1:{registry.port}", insecure=True)
    client.pull(target=f"127.0.0.1:{registry.port}/team-a/kimi:v1", outdir=str(pulled))
    assert files_of(pulled) == files_of(bundle)
    assert install(str(pulled), tmp_path / "node-from-oras", trusted_keys=[str(pub)],
                   require_signature=True).installed == n

    # something else oras pushed is not taken for a bundle
    (tmp_path / "notes.txt").write_text("not a bundle")
    client.push(target=f"127.0.0.1:{registry.port}/team-a/notes:v1", files=[str(tmp_path / "notes.txt")],
                disable_path_validation=True, quiet=True)
    p = run_cli("install", registry.url("team-a/notes:v1"), "--cache-dir", tmp_path / "node3", "--insecure",
                check=StoreError.exit_code)
    assert "holds no prewarm bundle" in p.stderr and not (tmp_path / "node3").exists()


def test_a_second_push_to_a_new_tag_uploads_no_object_and_a_changed_bundle_only_its_new_objects(
    toy_cache_master, registry, tmp_path
):
    smaller = copy_cache(toy_cache_master, tmp_path / "smaller")
    dropped = sorted(d for d in smaller.iterdir() if d.name != META)[0]
    shutil.rmtree(dropped)
    pack(smaller, tmp_path / "b1")
    pack(copy_cache(toy_cache_master, tmp_path / "full"), tmp_path / "b2")
    objects1 = {p.name for p in (tmp_path / "b1" / OBJECTS).iterdir()}
    objects2 = {p.name: p.stat().st_size for p in (tmp_path / "b2" / OBJECTS).iterdir()}
    [new_object] = set(objects2) - objects1

    def pushed(bundle, ref):
        before = len(blob_uploads(registry))
        [res] = push(bundle, [registry.url(ref)], storage_options=INSECURE)
        assert res.ok, res.error
        return res, {d.removeprefix("sha256:") for d in blob_uploads(registry)[before:]}

    res, uploaded = pushed(tmp_path / "b1", "dedup/kimi:v1")
    assert res.sent == len(objects1) and {f"{d}.tar.zst" for d in uploaded} >= objects1

    res, uploaded = pushed(tmp_path / "b1", "dedup/kimi:v2")  # unchanged bundle, new tag
    assert (res.sent, res.bytes_sent, res.present) == (0, 0, len(objects1))
    assert uploaded == set()  # the registry's log: not one blob upload, only the manifest PUT
    assert manifest_of(registry, "dedup/kimi:v1")[2] == manifest_of(registry, "dedup/kimi:v2")[2]

    res, uploaded = pushed(tmp_path / "b2", "dedup/kimi:v3")  # one more entry
    assert (res.sent, res.bytes_sent) == (1, objects2[new_object])
    index2 = hashlib.sha256((tmp_path / "b2" / INDEX).read_bytes()).hexdigest()
    assert uploaded == {new_object.removesuffix(".tar.zst"), index2}  # the new object and the new index


def test_pull_by_digest_and_a_moved_tag_is_reported(toy_cache_master, registry, tmp_path):
    pack(toy_cache_master, tmp_path / "b1")
    smaller = copy_cache(toy_cache_master, tmp_path / "smaller")
    shutil.rmtree(sorted(d for d in smaller.iterdir() if d.name != META)[0])
    pack(smaller, tmp_path / "b2")
    n1 = len(list((tmp_path / "b1" / OBJECTS).iterdir()))
    push(tmp_path / "b1", [registry.url("moving/kimi:stable")], storage_options=INSECURE)
    pinned = manifest_of(registry, "moving/kimi:stable")[2]
    push(tmp_path / "b2", [registry.url("moving/kimi:stable")], storage_options=INSECURE)  # the tag moves
    now = manifest_of(registry, "moving/kimi:stable")[2]
    assert now != pinned

    r = install(registry.url(f"moving/kimi@{pinned}"), tmp_path / "node1", storage_options=INSECURE)
    assert r.installed == n1  # the pinned bundle, not what the tag holds now

    p = run_cli("install", registry.url(f"moving/kimi:stable@{pinned}"), "--cache-dir", tmp_path / "node2",
                "--insecure", env=dict(os.environ, COLUMNS="300"))
    assert f"moving/kimi:stable now points to {now}" in p.stderr and f"installed {n1} entries" in p.stdout

    # a digest the repository does not have: the registry's own words, exit 10
    missing = "sha256:" + "0" * 64
    p = run_cli("install", registry.url(f"moving/kimi@{missing}"), "--cache-dir", tmp_path / "node3", "--insecure",
                check=StoreError.exit_code)
    assert "MANIFEST_UNKNOWN" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("install", registry.url("moving/kimi:never-pushed"), "--cache-dir", tmp_path / "node3",
                "--insecure", check=StoreError.exit_code)
    assert "MANIFEST_UNKNOWN" in p.stderr and not (tmp_path / "node3").exists()


@pytest.mark.parametrize("what", ["object", "index"])
def test_a_tampered_blob_in_the_registry_is_refused_and_the_cache_untouched(
    toy_cache_master, registry_factory, tmp_path, what
):
    server = registry_factory()
    pack(toy_cache_master, tmp_path / "bundle")
    url = server.url("tamper/kimi:v1")
    [res] = push(tmp_path / "bundle", [url], storage_options=INSECURE)
    assert res.ok
    if what == "object":
        name = sorted((tmp_path / "bundle" / OBJECTS).iterdir())[0].name
        digest = name.removesuffix(".tar.zst")
    else:
        digest = hashlib.sha256((tmp_path / "bundle" / INDEX).read_bytes()).hexdigest()
    blob = server.blob_path(digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: the registry serves it as it is
    blob.write_bytes(bytes(data))

    node = tmp_path / "node"
    (node / "other-entry").mkdir(parents=True)
    (node / "other-entry" / "k.bin").write_bytes(b"the node's own JIT output")
    before = files_of(node)
    p = run_cli("install", url, "--cache-dir", node, "--insecure", check=IntegrityError.exit_code)
    assert digest in p.stderr.replace("\n", "") and "Traceback" not in p.stderr
    assert {k: v for k, v in files_of(node).items() if not k.startswith(META)} == before


def test_registry_stopped_mid_push_fails_that_target_only(toy_cache_master, registry_factory, tmp_path):
    server = registry_factory()
    pack(toy_cache_master, tmp_path / "bundle")
    bad, good = server.url("gone/kimi:v1"), f"file://{tmp_path / 'good'}"

    def stop_registry_after_first_object(url, done, total):
        if url == bad and done == 1:
            server.stop()

    res_bad, res_good = push(tmp_path / "bundle", [bad, good], storage_options=INSECURE, attempts=3, backoff=0.05,
                             workers=1, progress=stop_registry_after_first_object)
    assert res_good.ok and res_good.sent == len(list((tmp_path / "bundle" / OBJECTS).iterdir()))
    assert not res_bad.ok and res_bad.sent == 1 and res_bad.retries >= 2
    assert "failed after 3 attempts" in res_bad.error and bad in res_bad.error
    # the manifest is PUT last: the half-pushed repository has blobs but no manifest, nothing installable
    repo = server.root / "docker/registry/v2/repositories/gone/kimi"
    assert (repo / "_layers").is_dir() and not (repo / "_manifests").exists()

    # the CLI, registry still down: exit 10, the registry named, the other target complete
    p = run_cli("push", tmp_path / "bundle", bad, f"file://{tmp_path / 'good2'}", "--insecure", "--retries", "1",
                "--json", check=StoreError.exit_code)
    doc = json.loads(p.stdout)
    assert [t["ok"] for t in doc["targets"]] == [False, True] and "Connection" in doc["targets"][0]["error"]
    assert (tmp_path / "good2" / INDEX).exists()


def test_a_failing_registry_is_retried_then_exit_10_in_its_own_words(toy_cache_master, registry_factory, tmp_path):
    server = registry_factory()
    blobs = server.root / "docker/registry/v2/blobs"  # a file where the blob store's dir goes: every upload fails
    blobs.parent.mkdir(parents=True)
    blobs.write_text("not a directory")
    pack(toy_cache_master, tmp_path / "bundle")
    p = run_cli("push", tmp_path / "bundle", server.url("broken/kimi:v1"), "--insecure", "--retries", "1", "--json",
                check=StoreError.exit_code)
    [target] = json.loads(p.stdout)["targets"]
    assert target["retries"] >= 1 and "HTTP 500: UNKNOWN: unknown error" in target["error"]
    assert "failed after 2 attempts" in target["error"]


def test_16_concurrent_installs_from_the_registry_unpack_once(toy_cache_master, registry, tmp_path):
    pack(toy_cache_master, tmp_path / "bundle")
    objects = {p.name.removesuffix(".tar.zst") for p in (tmp_path / "bundle" / OBJECTS).iterdir()}
    url = registry.url("fleet/kimi:v1")
    [res] = push(tmp_path / "bundle", [url], storage_options=INSECURE)
    assert res.ok
    before = len(registry.requests())
    results = concurrent_installs(url, tmp_path / "node", storage_options=INSECURE)
    assert sum(installed for installed, _ in results) == len(objects) and sum(noop for _, noop in results) == 15
    # the registry's log: each object was fetched once, by the one install that unpacked
    object_gets = [uri for method, uri, status in registry.requests()[before:]
                   if method == "GET" and "/blobs/sha256:" in uri and uri.rsplit(":", 1)[1] in objects]
    assert len(object_gets) == len(objects)
    assert verify(tmp_path / "node").ok


def test_references_options_and_tls_are_checked_before_anything_is_sent(registry, tmp_path):
    for url, words in [
        ("oci://127.0.0.1:5000/Kimi:v1", "repository 'Kimi'"),
        ("oci://127.0.0.1:5000/kimi", "a :TAG or @sha256:DIGEST"),
        ("oci://127.0.0.1:5000/kimi@sha256:abc", "digest 'sha256:abc'"),
    ]:
        with pytest.raises(StoreError, match=words):
            OciStore(url)
    with pytest.raises(StoreError, match="only allowed for a loopback registry"):
        OciStore("oci://registry.example.com/kimi:v1", insecure=True)
    with pytest.raises(StoreError, match="unknown OCI store option"):
        open_oci("oci://127.0.0.1:5000/kimi:v1", {"endpoint_url": "x"})
    with pytest.raises(StoreError, match="bad OCI store option value"):
        open_oci("oci://127.0.0.1:5000/kimi:v1", {"timeout": "soon"})
    with pytest.raises(StoreError, match="'Staging' is not a repository name"):
        open_oci("oci://127.0.0.1:5000/kimi:v1", {"mount_from": "Staging"})
    with pytest.raises(StoreError, match="push to a tag"):
        OciStore(f"oci://127.0.0.1:5000/kimi@sha256:{'0' * 64}", insecure=True).write(INDEX, b"{}")
    # TLS is the default: a plain-HTTP registry without --insecure is refused at once, with the hint
    p = run_cli("install", registry.url("tls/kimi:v1"), "--cache-dir", tmp_path / "node", check=StoreError.exit_code)
    assert "TLS failed" in p.stderr and "--insecure" in p.stderr


def _self_signed(d: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, made with cryptography."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prewarm test registry")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return d / "cert.pem", d / "key.pem"


def test_tls_is_verified_and_credentials_come_from_the_docker_config(toy_cache_master, registry_factory, tmp_path):
    (tmp_path / "htpasswd").write_text(f"alice:{bcrypt.hashpw(b's3cret', bcrypt.gensalt(4)).decode()}\n")
    cert, key = _self_signed(tmp_path)
    server = registry_factory(tls=(cert, key), htpasswd=tmp_path / "htpasswd")
    pack(toy_cache_master, tmp_path / "bundle")
    url = server.url("private/kimi:v1")
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONFIG", "REGISTRY_AUTH_FILE")}
    env["HOME"] = str(tmp_path / "home")  # no ~/.docker/config.json of the machine's
    # TLS on by default: an unknown CA is refused, nothing sent
    p = run_cli("push", tmp_path / "bundle", url, "--json", env=env, check=StoreError.exit_code)
    assert "CERTIFICATE_VERIFY_FAILED" in json.loads(p.stdout)["targets"][0]["error"]
    # the CA trusted, no credentials: the registry's refusal, exit 10
    env["REQUESTS_CA_BUNDLE"] = str(cert)
    p = run_cli("push", tmp_path / "bundle", url, "--json", env=env, check=StoreError.exit_code)
    assert "refused our credentials" in json.loads(p.stdout)["targets"][0]["error"]
    # `docker login`'s file: push and install work
    (tmp_path / "docker").mkdir()
    auth = base64.b64encode(b"alice:s3cret").decode()
    (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {f"127.0.0.1:{server.port}":
                                                                            {"auth": auth}}}))
    env["DOCKER_CONFIG"] = str(tmp_path / "docker")
    assert json.loads(run_cli("push", tmp_path / "bundle", url, "--json", env=env).stdout)["ok"]
    res = json.loads(run_cli("install", url, "--cache-dir", tmp_path / "node", "--json", env=env).stdout)
    assert res["installed"] == len(list((tmp_path / "bundle" / OBJECTS).iterdir()))


def test_a_push_to_another_repository_mounts_what_a_sibling_has(toy_cache_master, registry, tmp_path):
    pack(toy_cache_master, tmp_path / "bundle")
    n = len(list((tmp_path / "bundle" / OBJECTS).iterdir()))
    [res] = push(tmp_path / "bundle", [registry.url("promote/staging:v1")], storage_options=INSECURE)
    assert res.ok and res.sent == n
    before = len(blob_uploads(registry))
    env = dict(os.environ, FSSPEC_OCI_MOUNT_FROM="promote/nothing-here,promote/staging")
    doc = json.loads(run_cli("push", tmp_path / "bundle", registry.url("promote/prod:v1"), "--insecure", "--json",
                             env=env).stdout)
    [target] = doc["targets"]
    assert target["ok"] and (target["sent"], target["bytes_sent"], target["present"]) == (0, 0, n)
    index = hashlib.sha256((tmp_path / "bundle" / INDEX).read_bytes()).hexdigest()
    assert {d.removeprefix("sha256:") for d in blob_uploads(registry)[before:]} == {index}  # objects: mounted
    mounts = [uri for method, uri, status in registry.requests() if method == "POST" and "mount=" in uri
              and status == 201 and "/v2/promote/prod/" in uri]
    assert len(mounts) == n
    res = install(registry.url("promote/prod:v1"), tmp_path / "node", storage_options=INSECURE)
    assert res.installed == n and verify(tmp_path / "node").ok
