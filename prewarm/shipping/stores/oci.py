"""OCI registries as bundle stores: ``oci://HOST[:PORT]/REPO:TAG``, ``oci://HOST[:PORT]/REPO@sha256:HEX`` (pinned),
or ``oci://HOST[:PORT]/REPO:TAG@sha256:HEX`` (pinned; a tag that has moved since is reported).

A bundle is one OCI image manifest (image-spec 1.1, ``artifactType`` ``ARTIFACT_TYPE``)::

    config      index.json                                  INDEX_MEDIA_TYPE
    layers      objects/<sha256>.tar.zst, one per object    OBJECT_MEDIA_TYPE
                index.json.sig, when the bundle is signed   SIGNATURE_MEDIA_TYPE
                index.json                                  INDEX_MEDIA_TYPE
    annotations bundle name, manifest name and digest, index digest, fingerprint summary, prewarm version

An object's name is the sha256 of its bytes, so it is its blob digest as is: the registry stores each object once
whatever the tags and repositories, and a push HEADs every blob first and uploads only those the repository lacks.
Every layer carries its bundle path as ``org.opencontainers.image.title``, so ``oras pull`` writes exactly the
bundle directory (``prewarm install DIR`` reads it); the index is also the config, so the artifact is typed.
The manifest is the commit point, like index.json in a directory store: it is PUT last, after every blob it names;
it holds no timestamps, so the same bundle always makes the same manifest digest under any tag.

Reading pins everything to one manifest, fetched once: its digest is checked when the URL names one, the index blob
against the config digest, each object by install against its name. oras (oras-py) is the client: its Registry's
auth (docker config, credential helpers, bearer tokens), container URLs and upload-location handling. It lacks a
blob upload from memory (``upload_blob`` takes a file path), raw manifest bytes (``get_manifest`` returns parsed
JSON, so a pinned digest could not be checked), HTTP Basic challenges (``_Auth``), request timeouts and a bounded
retry (its ``do_request`` sleeps 3, 5, 11, 29 and 83 s between attempts): those few requests go through its
``do_request`` without that retry loop, and ``base.retry`` owns retries as for every other store.

Options (``storage_options`` or ``FSSPEC_OCI='{"insecure": true}'``, the same channel as the other stores):
``insecure`` (plain HTTP, loopback registries only; TLS is verified otherwise, with ``REQUESTS_CA_BUNDLE`` for a
private CA), ``timeout`` (seconds per request) and ``mount_from`` (repositories of the same registry, e.g.
``FSSPEC_OCI_MOUNT_FROM=staging/kimi``: a push links the objects they hold instead of uploading them again; by
default a push to a second repository uploads its objects once more, the registry stores them once).
Credentials: ``$DOCKER_CONFIG/config.json``, ``~/.docker/config.json`` and ``$REGISTRY_AUTH_FILE``, as
``docker login`` / ``oras login`` / podman write them.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import ipaddress
import json
import logging
import os
import re
from dataclasses import dataclass

import fsspec
import oras.auth
import oras.container
import oras.provider
import oras.utils
import requests

from ..bundle import INDEX, MAX_INDEX_BYTES, OBJECTS, SIGNATURE, parse_index, read_bounded
from ...errors import IntegrityError, StoreError
from .base import Store

ARTIFACT_TYPE = "application/vnd.prewarm.bundle.v1"
INDEX_MEDIA_TYPE = "application/vnd.prewarm.bundle.index.v1+json"
OBJECT_MEDIA_TYPE = "application/vnd.prewarm.bundle.object.v1.tar+zstd"
SIGNATURE_MEDIA_TYPE = "application/vnd.prewarm.bundle.signature.v1.ed25519"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
TITLE = "org.opencontainers.image.title"
ANNOTATION = "dev.prewarm"  # prefix of our own manifest annotations
FINGERPRINT_SUMMARY = ("target.backend", "target.arch", "triton.distribution", "triton.version", "python.abi",
                       "cuda.ptxas", "ascend.cann.version")

# the distribution spec's grammar for repository names, tags and digests
_REPO_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_OBJECT_NAME = re.compile(rf"^{OBJECTS}/([0-9a-f]{{64}})\.tar\.zst$")

log = logging.getLogger(__name__)


class RegistryUnavailable(Exception):
    """A 5xx or 429 answer: transient, retried by ``base.retry`` like a dropped connection."""


@dataclass(frozen=True)
class Reference:
    host: str  # HOST[:PORT]
    repo: str
    tag: str | None
    digest: str | None  # "sha256:<hex>": pinned

    @classmethod
    def parse(cls, url: str) -> Reference:
        rest = url.removeprefix("oci://")
        host, _, path = rest.partition("/")
        path, _, digest = path.partition("@")
        repo, _, tag = path.rpartition(":") if ":" in path else (path, "", "")
        problems = []
        if not host or not _REPO_RE.match(repo):
            problems.append(f"repository {repo!r} (lowercase letters, digits, separators ._-, '/' between parts)")
        if tag and not _TAG_RE.match(tag):
            problems.append(f"tag {tag!r}")
        if digest and not _DIGEST_RE.match(digest):
            problems.append(f"digest {digest!r} (sha256:<64 hex>)")
        if not tag and not digest:
            problems.append("a :TAG or @sha256:DIGEST")
        if problems:
            raise StoreError(f"{url}: not an OCI reference oci://HOST[:PORT]/REPO:TAG or .../REPO@sha256:HEX: "
                             f"bad or missing {'; '.join(problems)}")
        return cls(host, repo, tag or None, digest or None)

    @property
    def is_loopback(self) -> bool:
        name = self.host.rsplit(":", 1)[0] if not self.host.endswith("]") else self.host
        name = name.strip("[]")
        if name == "localhost":
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False


class _Session(requests.Session):
    """A requests session whose requests time out (oras passes none: a silent registry would hang a node)."""

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout

    def request(self, *args, **kwargs):
        kwargs.setdefault("timeout", self.timeout)
        return super().request(*args, **kwargs)


class _Auth(oras.auth.TokenAuth):
    """oras's bearer-token auth, plus HTTP Basic for registries that challenge with it (htpasswd, some on-prem
    ones): oras-py fixes one scheme up front, and its token flow would take a Basic realm's name for a token
    server's host. Once challenged, the session sends the credentials with every request to this registry
    (requests drops them on a redirect to another host, e.g. a blob in S3)."""

    def authenticate_request(self, original: requests.Response, headers: dict, refresh: bool = False):
        if not original.headers.get("Www-Authenticate", "").lower().startswith("basic"):
            return super().authenticate_request(original, headers, refresh)
        if not getattr(self, "_basic_auth", None):
            return headers, False
        self.session.headers["Authorization"] = f"Basic {self._basic_auth}"
        return {**(headers or {}), "Authorization": f"Basic {self._basic_auth}"}, True


class _Registry(oras.provider.Registry):
    """oras's client, its requests made once each: ``base.retry`` retries (bounded, logged in the push report)."""

    do_request = oras.provider.Registry.do_request.__wrapped__

    def __init__(self, host: str, insecure: bool, timeout: float):
        super().__init__(hostname=host, insecure=insecure)
        cookies = self.session.cookies  # oras's policy: ignore every cookie (Harbor sets CSRF ones)
        self.session = _Session(timeout)
        self.session.cookies = cookies
        self.auth = _Auth()  # wired as oras.auth.get_auth_backend wires its own
        self.auth.session, self.auth.prefix, self.auth._tls_verify = self.session, self.prefix, True


def _auth_files() -> list[str]:
    """Docker-format credential files besides ~/.docker/config.json (which oras always reads)."""
    files = []
    if os.environ.get("DOCKER_CONFIG"):
        files.append(os.path.join(os.environ["DOCKER_CONFIG"], "config.json"))
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(os.environ["REGISTRY_AUTH_FILE"])
    return [f for f in files if os.path.exists(f)]


def _registry_message(r: requests.Response) -> str:
    """The registry's own words: the OCI error body (code: message; detail), else the HTTP reason."""
    try:
        errors = r.json().get("errors") or []
        parts = [f"{e.get('code', '?')}: {e.get('message', '')}" + (f" ({e['detail']})" if e.get("detail") else "")
                 for e in errors if isinstance(e, dict)]
    except Exception:
        parts = []
    return "; ".join(parts) or r.reason or "no message"


def fingerprint_summary(fp: dict[str, str]) -> str:
    return " ".join(f"{k}={fp[k]}" for k in FINGERPRINT_SUMMARY if k in fp)


class OciStore(Store):
    """One repository of an OCI registry, at a tag or a pinned manifest digest (see the module docstring)."""

    def __init__(self, url: str, insecure: bool = False, timeout: float = 60, mount_from: tuple[str, ...] = ()):
        self.url = url
        self.ref = Reference.parse(url)
        if bad := [r for r in mount_from if not _REPO_RE.match(r)]:
            raise StoreError(f"{url}: mount_from: {', '.join(map(repr, bad))} is not a repository name")
        self.mount_from = tuple(mount_from)  # repositories of this registry whose blobs a push mounts, not uploads
        if insecure and not self.ref.is_loopback:
            raise StoreError(f"{url}: insecure (plain HTTP) is only allowed for a loopback registry "
                             f"(localhost, 127.0.0.0/8, ::1); {self.ref.host} must use TLS")
        self.registry = _Registry(self.ref.host, insecure, timeout)
        self.container = self._container(self.ref.repo)
        self.registry.auth.load_configs(self.container, configs=_auth_files())
        self._manifest: dict | None = None  # the manifest this store reads from, fetched once
        self.manifest_digest: str | None = None  # of that manifest, or of the one this store pushed
        self._signature: dict | None = None  # descriptor of a signature written before the index
        self._absent: set[str] = set()  # digests missing() just found absent: their upload skips a second HEAD

    # --- requests ------------------------------------------------------------------------------------------

    def _container(self, repo: str) -> oras.container.Container:
        """oras's URL builder for a repository of this registry. Its fields are set, not parsed: its parser takes
        a first path part with a dot ("my.team/kimi") for a registry host."""
        container = oras.container.Container(f"x:{self.ref.tag or 'latest'}", self.ref.host)
        namespace, _, container.repository = repo.rpartition("/")
        container.namespace = namespace or None
        container.registry = self.ref.host
        return container

    def _url(self, path: str) -> str:
        return f"{self.registry.prefix}://{path}"

    def _request(self, method: str, url: str, what: str, ok=(200, 201, 202), **kwargs) -> requests.Response:
        """One request; 404 -> FileNotFoundError, 5xx/429/connection -> transient, other answers -> StoreError."""
        where = f"{self.url}: {what}"
        try:
            r = self.registry.do_request(url, method, **kwargs)
        except requests.exceptions.SSLError as e:
            hint = " (a plain-HTTP loopback registry needs --insecure)" if self.ref.is_loopback else ""
            raise StoreError(f"{where}: TLS failed{hint}: {e}") from None
        except ValueError as e:  # oras: a 401 it could not answer with any credential it found
            raise StoreError(f"{where}: the registry refused our credentials ({e}); log in with "
                             f"`docker login {self.ref.host}` or set DOCKER_CONFIG / REGISTRY_AUTH_FILE") from None
        if r.status_code in ok:
            return r
        message = _registry_message(r)
        if r.status_code == 404:
            raise FileNotFoundError(f"{where}: not in the registry: {message}")
        if r.status_code >= 500 or r.status_code == 429:
            raise RegistryUnavailable(f"{where}: HTTP {r.status_code}: {message}")
        raise StoreError(f"{where}: HTTP {r.status_code}: {message}")

    def _blob_url(self, digest: str) -> str:
        return self._url(self.container.get_blob_url(digest))

    def _stream(self, url: str, what: str, **kwargs):
        r = self._request("GET", url, what, stream=True, **kwargs)
        r.raw.decode_content = True
        return r.raw

    def has_blob(self, digest: str, repo: str | None = None) -> bool:
        """Whether this repository (or ``repo`` of the same registry) has the blob."""
        container = self.container if repo is None else self._container(repo)
        try:
            self._request("HEAD", self._url(container.get_blob_url(digest)), f"HEAD blob {digest} in {repo or 'it'}")
            return True
        except FileNotFoundError:
            return False

    def _mount(self, digest: str) -> bool:
        """Link a blob that a ``mount_from`` repository has into this one: no bytes sent (cross-repository mount)."""
        for repo in self.mount_from:
            if self.has_blob(digest, repo):
                url = oras.utils.append_url_params(self._url(self.container.upload_blob_url()),
                                                   {"mount": digest, "from": repo})
                if self._request("POST", url, f"mount {digest} from {repo}", ok=(201, 202)).status_code == 201:
                    return True  # (202: the registry opened an upload instead; it expires unused)
        return False

    def _put_blob(self, data: bytes, media_type: str, title: str) -> dict:
        """Upload a blob the repository lacks (HEAD first); its descriptor for the manifest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest in self._absent or not self.has_blob(digest):
            start = self._request("POST", self._url(self.container.upload_blob_url()), f"start upload of {title}",
                                  headers={"Content-Type": "application/octet-stream", "Content-Length": "0"})
            location = self.registry._get_location(start, self.container)
            if not location:
                raise StoreError(f"{self.url}: upload of {title}: the registry gave no upload location")
            self._request("PUT", oras.utils.append_url_params(location, {"digest": digest}), f"upload {title}",
                          data=data, headers={"Content-Type": "application/octet-stream"})
        return {"mediaType": media_type, "digest": digest, "size": len(data), "annotations": {TITLE: title}}

    # --- the manifest --------------------------------------------------------------------------------------

    def manifest(self) -> dict:
        """The bundle's manifest, fetched once (every later read comes from it); checked against a pinned digest."""
        if self._manifest is not None:
            return self._manifest
        ref = self.ref.digest or self.ref.tag
        what = f"manifest {ref}"
        url = self._url(self.container.manifest_url(ref))
        stream = self._stream(url, what, headers={"Accept": MANIFEST_MEDIA_TYPE})
        body = read_bounded(stream, MAX_INDEX_BYTES, f"{self.url}: {what}")  # it grows with the index
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if self.ref.digest and digest != self.ref.digest:
            raise IntegrityError(f"{self.url}: the registry's manifest has digest {digest}: corrupted or tampered")
        try:
            doc = json.loads(body)
            assert isinstance(doc, dict) and isinstance(doc.get("config"), dict)
        except (ValueError, AssertionError):
            raise IntegrityError(f"{self.url}: manifest {digest} is not an OCI image manifest") from None
        if doc.get("artifactType") != ARTIFACT_TYPE or doc["config"].get("mediaType") != INDEX_MEDIA_TYPE:
            raise StoreError(f"{self.url}: holds no prewarm bundle (artifactType {doc.get('artifactType')!r}, "
                             f"config {doc['config'].get('mediaType')!r}; expected {ARTIFACT_TYPE})")
        if self.ref.digest and self.ref.tag:
            self._report_moved_tag()
        self.manifest_digest = digest
        self._manifest = doc
        return doc

    def _report_moved_tag(self) -> None:
        url = self._url(self.container.manifest_url(self.ref.tag))
        try:
            now = self._request("HEAD", url, f"tag {self.ref.tag}", headers={"Accept": MANIFEST_MEDIA_TYPE})
            moved_to = now.headers.get("Docker-Content-Digest")
        except FileNotFoundError:
            moved_to = "nothing (deleted)"
        if moved_to != self.ref.digest:
            note = (f"{self.ref.host}/{self.ref.repo}:{self.ref.tag} now points to {moved_to}; "
                    f"reading the pinned {self.ref.digest}")
            log.warning(note)  # the CLI shows it on stderr (logging's last resort); the install goes on

    def _descriptor(self, name: str) -> dict:
        doc = self.manifest()
        if name == INDEX:
            return doc["config"]
        for layer in doc.get("layers") or ():
            if isinstance(layer, dict) and layer.get("mediaType") == SIGNATURE_MEDIA_TYPE:
                return layer
        raise FileNotFoundError(f"{self.url}: the bundle is not signed (no {SIGNATURE} layer)")

    def _manifest_for(self, index_bytes: bytes) -> bytes:
        index = parse_index(index_bytes, f"{self.url}: {INDEX}")
        digest = "sha256:" + hashlib.sha256(index_bytes).hexdigest()
        config = {"mediaType": INDEX_MEDIA_TYPE, "digest": digest, "size": len(index_bytes)}
        objects = sorted({(e.object, e.object_size) for e in index.entries})
        layers = [{"mediaType": OBJECT_MEDIA_TYPE, "digest": "sha256:" + name.split(".", 1)[0], "size": size,
                   "annotations": {TITLE: f"{OBJECTS}/{name}"}} for name, size in objects]
        if self._signature:
            layers.append(self._signature)
        layers.append({**config, "annotations": {TITLE: INDEX}})
        manifest = index.manifest or {}
        notes = {
            TITLE: manifest.get("name") or "prewarm bundle",
            f"{ANNOTATION}.index.digest": digest,
            f"{ANNOTATION}.entries": str(len(index.entries)),
            f"{ANNOTATION}.fingerprint": fingerprint_summary(index.fingerprint),
            f"{ANNOTATION}.version": index.tool,  # the prewarm that packed it
            **{f"{ANNOTATION}.manifest.{k}": manifest[k] for k in ("name", "digest") if manifest.get(k)},
        }
        doc = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE,
               "config": config, "layers": layers, "annotations": notes}
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    # --- the Store interface -------------------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        if _OBJECT_NAME.match(name):  # named by the (checked) index; install checks its sha256
            with self.open(name) as f:
                return f.read()
        if name not in (INDEX, SIGNATURE):
            raise FileNotFoundError(f"{self.url}: a bundle has no {name}")
        try:
            desc = self._descriptor(name)
        except FileNotFoundError as e:
            if name == INDEX:  # no manifest at this reference: say so in the registry's words
                raise StoreError(f"{e} (push a bundle there with `prewarm push BUNDLE {self.url}`)") from None
            raise
        size = desc.get("size")
        if not isinstance(size, int) or not 0 <= size <= MAX_INDEX_BYTES:
            raise IntegrityError(f"{self.url}: manifest lists {name} with size {size!r}: malformed")
        data = read_bounded(self._stream(self._blob_url(desc["digest"]), name), size, f"{self.url}: {name}")
        if "sha256:" + hashlib.sha256(data).hexdigest() != desc["digest"]:
            raise IntegrityError(f"{self.url}: blob {desc['digest']} ({name}) does not match its digest: tampered")
        return data

    def open(self, name: str):
        """Objects stream from the registry (install checks them as they are written); the rest via ``read``."""
        if m := _OBJECT_NAME.match(name):
            return self._stream(self._blob_url(f"sha256:{m.group(1)}"), name)
        return io.BytesIO(self.read(name))

    def write(self, name: str, data: bytes) -> None:
        if self.ref.digest:
            raise StoreError(f"{self.url}: push to a tag (oci://HOST/REPO:TAG), not to a manifest digest")
        if _OBJECT_NAME.match(name):
            self._put_blob(data, OBJECT_MEDIA_TYPE, name)
        elif name == SIGNATURE:
            self._signature = self._put_blob(data, SIGNATURE_MEDIA_TYPE, SIGNATURE)
        elif name == INDEX:  # last: the blobs it names are all there; the manifest makes the bundle visible
            self._put_blob(data, INDEX_MEDIA_TYPE, INDEX)
            body = self._manifest_for(data)
            r = self._request("PUT", self._url(self.container.manifest_url(self.ref.tag)), "PUT manifest",
                              data=body, headers={"Content-Type": MANIFEST_MEDIA_TYPE})
            self.manifest_digest = "sha256:" + hashlib.sha256(body).hexdigest()
            got = r.headers.get("Docker-Content-Digest")
            if got and got != self.manifest_digest:
                raise StoreError(f"{self.url}: the registry stored the manifest as {got}, "
                                 f"we sent {self.manifest_digest}")
        else:
            raise StoreError(f"{self.url}: a bundle has no {name}")

    def missing(self, names: set[str], workers: int = 8) -> set[str]:
        """The objects this repository lacks: one HEAD per blob (a registry lists no blobs); those a ``mount_from``
        repository has are mounted first and no longer lacking."""
        names = sorted(names)

        def present(name: str) -> bool:
            digest = "sha256:" + name.split(".", 1)[0]
            return self.has_blob(digest) or self._mount(digest)

        with cf.ThreadPoolExecutor(workers) as pool:
            have = list(pool.map(present, names))
        lacking = {n for n, h in zip(names, have) if not h}
        self._absent = {"sha256:" + n.split(".", 1)[0] for n in lacking}
        return lacking

    def list_objects(self) -> set[str]:
        """The objects the current manifest names (a registry cannot list blobs); empty before the first push."""
        try:
            layers = self.manifest().get("layers") or []
        except FileNotFoundError:
            return set()
        return {layer["annotations"][TITLE].split("/", 1)[1] for layer in layers
                if layer.get("mediaType") == OBJECT_MEDIA_TYPE}


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def _names(value) -> tuple[str, ...]:
    return tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)


OPTIONS = {"insecure": _flag, "timeout": float, "mount_from": _names}  # FSSPEC_OCI_<NAME> values arrive as strings


def open_oci(url: str, storage_options: dict | None = None) -> OciStore:
    """An OciStore, options from ``FSSPEC_OCI`` / ``FSSPEC_OCI_<NAME>`` (fsspec's config) and ``storage_options``."""
    options = {**fsspec.config.conf.get("oci", {}), **(storage_options or {})}
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise StoreError(f"{url}: unknown OCI store option(s) {', '.join(unknown)} (known: {', '.join(OPTIONS)})")
    try:
        options = {name: OPTIONS[name](value) for name, value in options.items()}
    except (TypeError, ValueError) as e:
        raise StoreError(f"{url}: bad OCI store option value ({e})") from None
    return OciStore(url, **options)
