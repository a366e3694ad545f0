"""Push to real stores on loopback (file://, moto's S3 server, OpenSSH sftp), end to end through the CLI."""
from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from prewarm.shipping.bundle import INDEX, OBJECTS
from prewarm.errors import IntegrityError, StoreError
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.stores import open_store, push
from prewarm.node.verify import verify

from prewarm_helpers import run_cli


def test_push_to_file_s3_sftp_in_one_command_then_install_each_and_verify(
    triton_cache, tmp_path, s3_server, sshd, cli_env
):
    bundle = tmp_path / "bundle"
    run_cli("pack", triton_cache, "-o", bundle, env=cli_env)
    n = len(list((bundle / OBJECTS).iterdir()))
    urls = [
        f"file://{tmp_path / 'store-file'}",
        f"s3://{s3_server.new_bucket()}/bundles/toy",
        sshd.url(tmp_path / "store-sftp"),
    ]
    first = json.loads(run_cli("push", bundle, *urls, "--json", env=cli_env).stdout)
    assert first["ok"]
    assert [t["sent"] for t in first["targets"]] == [n, n, n]

    again = json.loads(run_cli("push", bundle, *urls, "--json", env=cli_env).stdout)
    assert [(t["ok"], t["sent"], t["present"]) for t in again["targets"]] == [(True, 0, n)] * 3

    # the node's job through the CLI from the sftp store; the library (same code path) from the other two
    res = json.loads(run_cli("install", urls[2], "--cache-dir", tmp_path / "node2", "--json", env=cli_env).stdout)
    assert res["installed"] == n and not res["noop"]
    report = json.loads(run_cli("verify", "--cache-dir", tmp_path / "node2", "--json", env=cli_env).stdout)
    assert report["ok"] and report["entries_ok"] == n and report["exit_code"] == 0
    options = {"s3": s3_server.options, "sftp": sshd.options}
    for i, url in enumerate(urls[:2]):
        r = install(url, tmp_path / f"node{i}", storage_options=options.get(url.split("://")[0]))
        assert r.installed == n
        assert verify(tmp_path / f"node{i}").ok


def test_only_missing_objects_are_sent(triton_cache, tmp_path, s3_server):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    url = f"s3://{s3_server.new_bucket()}/b"
    store = open_store(url, s3_server.options)
    objects = sorted(p.name for p in (bundle / OBJECTS).iterdir())
    store.write(f"{OBJECTS}/{objects[0]}", (bundle / OBJECTS / objects[0]).read_bytes())
    calls = []
    [res] = push(bundle, [url], storage_options=s3_server.options, progress=lambda *a: calls.append(a))
    assert res.ok and res.present == 1 and res.sent == len(objects) - 1
    assert store.list_objects() == set(objects)
    # progress counts what this target lacks, from 0 to all of it
    n = len(objects) - 1
    assert calls[0] == (url, 0, n) and sorted(calls) == [(url, i, n) for i in range(n + 1)]
    calls.clear()
    [res] = push(bundle, [url], storage_options=s3_server.options, progress=lambda *a: calls.append(a))
    assert res.sent == 0 and calls == [(url, 0, 0)]


@pytest.mark.parametrize("protocol", ["s3", "sftp"])
def test_server_stopped_mid_push_retries_then_fails_cleanly_other_targets_succeed(
    triton_cache, tmp_path, protocol, request
):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    if protocol == "s3":
        server = request.getfixturevalue("own_s3_server")
        bad = f"s3://{server.new_bucket()}/b"
        opts = dict(server.options, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    else:  # sshd and the sessions it forked are killed: the open sftp connection drops mid-push
        server = request.getfixturevalue("own_sshd")
        bad = server.url(tmp_path / "sftp-target")
        opts = server.options
    good = f"file://{tmp_path / 'good'}"

    def stop_server_after_first_object(url, done, total):
        if url == bad and done == 1 and server.proc.poll() is None:
            server.stop()

    res_bad, res_good = push(
        bundle, [bad, good], storage_options=opts, attempts=3, backoff=0.05, workers=1,
        progress=stop_server_after_first_object,
    )
    assert res_good.ok and res_good.sent == len(list((bundle / OBJECTS).iterdir()))
    assert not res_bad.ok and res_bad.sent == 1
    assert res_bad.retries >= 2 and "failed after 3 attempts" in res_bad.error and bad in res_bad.error
    # the index is written last: the half-pushed target has no index, so nobody can install from it
    assert (tmp_path / "good" / INDEX).exists()
    if protocol == "sftp":
        assert not (tmp_path / "sftp-target" / INDEX).exists()  # same host: look at the target dir itself
    with pytest.raises(StoreError):
        install(bad, tmp_path / "node", storage_options=opts)


def test_push_cli_exit_code_names_failed_target(triton_cache, tmp_path, cli_env):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    (tmp_path / "ro").write_text("a file where a directory should be")
    p = run_cli("push", bundle, f"file://{tmp_path / 'ok'}", f"file://{tmp_path / 'ro'}", "--retries", "0",
                env=dict(cli_env, COLUMNS="500"), check=StoreError.exit_code)
    assert "FAILED" in p.stdout and str(tmp_path / "ro") in p.stdout.replace("\n", "")


def test_default_store_by_bundle_name(triton_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PREWARM_STORE", str(tmp_path / "default-store"))
    bundle = tmp_path / "kda-bundle"
    pack(triton_cache, bundle)
    [res] = push(bundle, [])
    assert res.ok and (tmp_path / "default-store" / "kda-bundle" / INDEX).exists()
    r = install("kda-bundle", tmp_path / "node")
    assert r.installed == len(list((bundle / OBJECTS).iterdir()))
    assert verify(tmp_path / "node").ok


def run_on_terminal(*args, env: dict) -> tuple[int, str, str]:
    """`prewarm ARGS` with stderr on a pseudo-terminal, as a person runs it: (exit code, stdout, terminal text)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "prewarm.cli", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=slave, env={**env, "TERM": "xterm-256color", "COLUMNS": "200"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout = p.stdout.read().decode()
    return p.wait(), stdout, b"".join(chunks).decode(errors="replace")


def test_push_and_install_show_progress_on_a_terminal_only(triton_cache, tmp_path, cli_env):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    n = len(list((bundle / OBJECTS).iterdir()))
    url = f"file://{tmp_path / 'store'}"
    rc, _, term = run_on_terminal("push", bundle, url, env=cli_env)
    assert rc == 0 and f"push {url}" in term and f"{n}/{n}" in term
    rc, stdout, term = run_on_terminal("install", url, "--cache-dir", tmp_path / "node", env=cli_env)
    assert rc == 0 and "install (fetch, check, stage)" in term and f"{n}/{n}" in term
    assert f"installed {n} entries" in stdout
    # piped (a pre-launch job's log): the results only, no progress redraws
    piped = run_cli("install", url, "--cache-dir", tmp_path / "node2", env=cli_env)
    assert "install (fetch, check, stage)" not in piped.stderr + piped.stdout


# --- issue 13: push never publishes corruption, repairs it, leaves no temp files -----------------------------------


def test_push_refuses_a_local_object_that_does_not_match_the_index(triton_cache, tmp_path):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    obj = sorted((bundle / OBJECTS).iterdir())[1]
    data = bytearray(obj.read_bytes())
    data[10] ^= 0x01
    obj.write_bytes(bytes(data))
    [res] = push(bundle, [f"file://{tmp_path / 'store'}"])
    assert not res.ok and obj.name in res.error and "corrupted" in res.error
    assert not (tmp_path / "store" / INDEX).exists()  # nobody can install the half-pushed bundle
    assert not (tmp_path / "store" / OBJECTS / obj.name).exists()


def test_push_checks_objects_already_in_a_file_store_and_replaces_bad_ones(triton_cache, tmp_path):
    bundle, store = tmp_path / "bundle", tmp_path / "store"
    pack(triton_cache, bundle)
    [first] = push(bundle, [f"file://{store}"])
    objects = sorted((store / OBJECTS).iterdir())
    flipped = bytearray(objects[0].read_bytes())
    flipped[-5] ^= 0x40
    objects[0].write_bytes(bytes(flipped))  # corrupted in place
    objects[1].write_bytes(objects[1].read_bytes()[:100])  # truncated
    with pytest.raises(IntegrityError):
        install(f"file://{store}", tmp_path / "node0")
    [res] = push(bundle, [f"file://{store}"])
    assert (res.ok, res.repaired, res.sent, res.present) == (True, 2, 2, first.sent - 2)
    [trusting] = push(bundle, [f"file://{store}"], verify_remote=False)  # by name only, as for s3 by default
    assert (trusting.repaired, trusting.sent) == (0, 0)
    install(f"file://{store}", tmp_path / "node")
    assert verify(tmp_path / "node").ok


def _push_with_fsize_limit(bundle: str, url: str, q) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # a full disk: every write past 1000 bytes fails
    [res] = push(bundle, [url], attempts=2, backoff=0.01)
    q.put((res.ok, res.error))


def test_push_to_a_full_store_fails_and_leaves_no_temp_files(triton_cache, tmp_path):
    import multiprocessing

    bundle, store = tmp_path / "bundle", tmp_path / "store"
    pack(triton_cache, bundle)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_push_with_fsize_limit, args=(str(bundle), f"file://{store}", q))
    p.start()
    ok, error = q.get(timeout=120)
    p.join()
    assert not ok and "File too large" in error
    assert [f for f in store.rglob("*") if f.is_file() and f.name.endswith(".tmp")] == []
    assert not (store / INDEX).exists()
