"""Push to real stores on loopback (file://, moto's S3 server, OpenSSH sftp), end to end through the CLI."""
from __future__ import annotations

import json

import pytest

from prewarm.bundle import INDEX, OBJECTS, pack
from prewarm.errors import StoreError
from prewarm.install import install
from prewarm.store import open_store, push
from prewarm.verify import verify

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
    [res] = push(bundle, [url], storage_options=s3_server.options)
    assert res.ok and res.present == 1 and res.sent == len(objects) - 1
    assert store.list_objects() == set(objects)


def test_server_stopped_mid_push_retries_then_fails_cleanly_other_targets_succeed(
    triton_cache, tmp_path, own_s3_server
):
    bundle = tmp_path / "bundle"
    pack(triton_cache, bundle)
    bad = f"s3://{own_s3_server.new_bucket()}/b"
    good = f"file://{tmp_path / 'good'}"
    sent = []

    def stop_server_after_first_object(url, name):
        sent.append(url)
        if url == bad and own_s3_server.proc.poll() is None:
            own_s3_server.stop()

    opts = dict(own_s3_server.options, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    res_bad, res_good = push(
        bundle, [bad, good], storage_options=opts, attempts=3, backoff=0.05, workers=1,
        on_object=stop_server_after_first_object,
    )
    assert res_good.ok and res_good.sent == len(list((bundle / OBJECTS).iterdir()))
    assert not res_bad.ok
    assert res_bad.retries >= 2 and "failed after 3 attempts" in res_bad.error
    # the index is written last: the half-pushed target has no index, so nobody can install from it
    assert (tmp_path / "good" / INDEX).exists()
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
