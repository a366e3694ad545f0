"""Shared fixtures: a small REAL Triton cache, and real servers on loopback (moto's S3 server, OpenSSH sshd, the
reference OCI registry).

Nothing is skipped: a missing ``sshd`` (apt package ``openssh-server``) or ``moto_server`` fails the tests
that need them.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from prewarm_helpers import build_toy_cache, copy_cache


def pytest_configure(config):
    # one fresh traffic seed per run (traffic.closure.fresh_seed), the same in every module and in every process a
    # test starts; a failing id names it (rerun: PREWARM_CLOSURE_SEED=<n>)
    os.environ.setdefault("PREWARM_CLOSURE_SEED", str(random.SystemRandom().randrange(10**3, 10**9)))


@pytest.fixture(scope="session", autouse=True)
def _triton_driver_at_start() -> dict:
    from triton.runtime.driver import driver

    return dict(vars(driver))


@pytest.fixture(scope="module", autouse=True)
def _no_target_left_active(request, _triton_driver_at_start):
    """A module that plans in this process activates a target-only driver and a device profile (torch.cuda answers as
    the profile); after it, the next module and every process it forks see this box again. Not in tests/ascend: its
    modules activate the Ascend target once, at import."""
    yield
    if "ascend" not in request.path.parts:
        from triton.runtime.driver import driver

        from prewarm import devices

        devices.deactivate()
        vars(driver).update(_triton_driver_at_start)


@pytest.fixture(scope="session")
def toy_cache_master(tmp_path_factory) -> Path:
    """A real Triton 3.6 cache (5 entries) compiled once per session. Read-only: use ``triton_cache``."""
    return build_toy_cache(tmp_path_factory.mktemp("toy") / "cache")


@pytest.fixture
def triton_cache(toy_cache_master, tmp_path) -> Path:
    """A private copy of the real toy cache (group files consistent with its location)."""
    return copy_cache(toy_cache_master, tmp_path / "triton-cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30, log: Path | None = None) -> None:
    """Until ``proc`` listens on ``port``; its output (``log``, else its stderr pipe) is in the error if it exits,
    and it is stopped if it does not listen in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = log.read_text() if log else proc.stderr.read().decode()
            raise RuntimeError(f"{what} exited with {proc.returncode}: {output[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _running(server):
    """A fixture's body: the started server, stopped after its tests."""
    yield server
    server.stop()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class S3Server:
    proc: subprocess.Popen
    endpoint: str

    @property
    def options(self) -> dict:
        """fsspec storage options for this server (also what FSSPEC_S3 carries for the CLI)."""
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}

    def new_bucket(self) -> str:
        import s3fs

        name = f"b-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **self.options).mkdir(name)
        return name

    def stop(self) -> None:
        _stop(self.proc)


def start_moto() -> S3Server:
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if exe is None:
        raise RuntimeError("moto_server not found: pip install 'moto[server]'")
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_port(port, proc, "moto_server")
    return S3Server(proc, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, a separate process on loopback, for the whole session."""
    yield from _running(start_moto())


@pytest.fixture
def own_s3_server():
    """A private moto server a test may stop (fault injection)."""
    yield from _running(start_moto())


@dataclass
class SSHServer:
    proc: subprocess.Popen
    port: int
    client_key: str
    user: str

    @property
    def options(self) -> dict:
        return {"client_keys": [self.client_key], "known_hosts": None}

    def url(self, path: str | os.PathLike) -> str:
        return f"sftp://{self.user}@127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        """Stop the listener and every session it forked: open connections drop, as when a host goes away.
        (Session processes call setsid(), so they are found by parentage, not by process group.)"""
        for pid in _descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _stop(self.proc)


def _descendants(root: int) -> list[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def start_sshd(d: Path) -> SSHServer:
    """OpenSSH's sshd on a high loopback port: temp host key, temp authorized key for the current user."""
    exe = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None)
    if exe is None:
        raise RuntimeError("sshd not found: install the apt package openssh-server")
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        textwrap.dedent(
            f"""
            Port {port}
            ListenAddress 127.0.0.1
            HostKey {d / "host"}
            AuthorizedKeysFile {d / "authorized_keys"}
            PidFile {d / "sshd.pid"}
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PubkeyAuthentication yes
            PermitRootLogin prohibit-password
            UsePAM no
            StrictModes no
            MaxStartups 100
            MaxSessions 100
            Subsystem sftp internal-sftp
            """
        )
    )
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    proc = subprocess.Popen([exe, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE)
    wait_port(port, proc, "sshd")
    import getpass

    return SSHServer(proc, port, str(d / "client"), getpass.getuser())


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """sshd for the whole session."""
    yield from _running(start_sshd(tmp_path_factory.mktemp("sshd")))


@pytest.fixture
def own_sshd(tmp_path_factory):
    """A private sshd a test may stop (fault injection)."""
    yield from _running(start_sshd(tmp_path_factory.mktemp("own-sshd")))


@pytest.fixture
def cli_env(s3_server, sshd) -> dict:
    """Environment for `prewarm` subprocesses: fsspec's own config carries the servers' options."""
    env = dict(os.environ)
    env["FSSPEC_S3"] = json.dumps(s3_server.options)
    env["FSSPEC_SFTP"] = json.dumps(sshd.options)
    return env




@dataclass
class RegistryServer:
    """The reference OCI registry (distribution, Debian's ``docker-registry``) on loopback, storage in a tmp dir."""

    proc: subprocess.Popen
    port: int
    root: Path  # the filesystem storage root
    log: Path

    def url(self, ref: str) -> str:
        """``oci://127.0.0.1:PORT/<ref>`` (ref = REPO:TAG or REPO@sha256:...)."""
        return f"oci://127.0.0.1:{self.port}/{ref}"

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (distribution's filesystem layout)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, URI, status) of every request the registry answered, from its own log."""
        out = []
        for line in self.log.read_text().splitlines():
            if 'msg="response completed"' in line:
                fields = dict(re.findall(r'([\w.]+)=("(?:[^"\\]|\\.)*"|\S+)', line))
                out.append((fields["http.request.method"], fields["http.request.uri"].strip('"'),
                            int(fields["http.response.status"])))
        return out

    def stop(self) -> None:
        _stop(self.proc)


def start_registry(d: Path, *, tls: tuple[Path, Path] | None = None, htpasswd: Path | None = None) -> RegistryServer:
    """``tls``: (certificate, key) to serve HTTPS with; ``htpasswd``: require HTTP Basic auth from that file."""
    exe = shutil.which("docker-registry") or shutil.which("registry")
    if exe is None:
        raise RuntimeError("docker-registry not found: install the apt package docker-registry (bash .ci/setup)")
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tls_conf = f"\n  tls:\n    certificate: {tls[0]}\n    key: {tls[1]}" if tls else ""
    auth_conf = f"auth:\n  htpasswd:\n    realm: prewarm-test\n    path: {htpasswd}" if htpasswd else ""
    (d / "config.yml").write_text(textwrap.dedent(
        f"""
        version: 0.1
        log:
          level: info
          accesslog:
            disabled: true
        storage:
          filesystem:
            rootdirectory: {d / "storage"}
          delete:
            enabled: true
        """
    ) + f"http:\n  addr: 127.0.0.1:{port}{tls_conf}\n{auth_conf}\n")
    log = d / "registry.log"
    with open(log, "wb") as f:  # a file, not a pipe: a long test would fill a pipe and stall the server
        proc = subprocess.Popen([exe, "serve", str(d / "config.yml")], stdout=f, stderr=subprocess.STDOUT)
    wait_port(port, proc, "docker-registry", log=log)
    return RegistryServer(proc, port, d / "storage", log)


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """An OCI registry for the whole session (tests use their own repositories)."""
    yield from _running(start_registry(tmp_path_factory.mktemp("registry")))


@pytest.fixture
def registry_factory(tmp_path_factory):
    """``start(tls=..., htpasswd=...)``: private registries a test may stop, tamper with or configure; all
    stopped after the test."""
    servers = []

    def start(**options) -> RegistryServer:
        servers.append(start_registry(tmp_path_factory.mktemp("registry"), **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
