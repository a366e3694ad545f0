"""Replaying a recording made on another machine: its machine-specific option values (libdevice's absolute path)
become this host's, so it builds into the same key dirs as a local recording; what cannot be made local is named."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from prewarm.building.build import build  # noqa: E402
from prewarm.cli import main  # noqa: E402
from prewarm.errors import ManifestError  # noqa: E402
from prewarm.planning.plan import load_record  # noqa: E402
from test_record import MANIFEST as APP_MANIFEST  # noqa: E402
from test_record import recorded as recording  # noqa: E402  (the fixture: a real `prewarm record` of the toy app)


@pytest.fixture(scope="module")
def recorded(recording):
    """The toy app's recording as ``local.jsonl`` beside the cache the app compiled into (``app-cache``)."""
    tmp, _ = recording
    (tmp / "local.jsonl").write_text((tmp / "app.jsonl").read_text())
    return tmp


ELSEWHERE = "/opt/h200-node/venv/lib/python3.12/site-packages/triton/backends/nvidia/lib/libdevice.10.bc"


def rewrite_options(src: Path, dst: Path, change) -> None:
    """Each line of ``src`` with ``change(options)`` applied to its specialization data's options, as another
    machine's recorder would have written it."""
    lines = []
    for line in src.read_text().splitlines():
        entry = json.loads(line)
        data = json.loads(entry["specialization_data"])
        change(data["options"])
        entry["specialization_data"] = json.dumps(data)
        lines.append(json.dumps(entry))
    dst.write_text("\n".join(lines) + "\n")


def manifest(tmp: Path, record: str) -> Path:
    path = tmp / f"{Path(record).stem}.toml"
    path.write_text(APP_MANIFEST.replace('record = "app.jsonl"', f'record = "{record}"'))
    return path


def test_a_recording_with_another_hosts_libdevice_builds_into_the_local_recordings_keys(recorded):
    tmp = recorded

    def elsewhere(options):
        assert [lib for lib, _ in options["extern_libs"]] == ["libdevice"]
        options["extern_libs"] = [["libdevice", ELSEWHERE]]

    rewrite_options(tmp / "local.jsonl", tmp / "remote.jsonl", elsewhere)
    assert not Path(ELSEWHERE).exists() and ELSEWHERE in (tmp / "remote.jsonl").read_text()
    # replayed, the remote recording is the very same requests as the local one
    assert [r.ident for r in load_record(str(tmp / "remote.jsonl"))] == \
        [r.ident for r in load_record(str(tmp / "local.jsonl"))]
    report = build(manifest(tmp, "remote.jsonl"), tmp / "built-remote", workers=1, mode="offline")
    assert report.ok and report.count("compiled") == 3
    # the key dirs the app compiled into on this host: a server here would find every kernel
    assert sorted(r.key for r in report.results) == sorted(p.name for p in (tmp / "app-cache").iterdir())


def test_a_path_that_cannot_be_made_local_is_named_with_file_line_and_option(recorded, capsys):
    tmp = recorded

    def foreign_lib(options):
        options["extern_libs"] = [["libdevice", ELSEWHERE], ["libvendor", "/opt/vendor/libvendor.bc"]]

    rewrite_options(tmp / "local.jsonl", tmp / "vendor.jsonl", foreign_lib)
    code = main(["build", str(manifest(tmp, "vendor.jsonl")), "--cache-dir", str(tmp / "built-vendor")])
    err = capsys.readouterr().err
    assert code == ManifestError.exit_code
    assert f"{tmp / 'vendor.jsonl'}:1: option extern_libs 'libvendor' = '/opt/vendor/libvendor.bc'" in err
    assert "Traceback" not in err
    assert not (tmp / "built-vendor").exists() or not any(p.name != ".prewarm" for p in (tmp / "built-vendor").iterdir())


def test_any_other_absolute_path_option_missing_here_is_named(recorded):
    tmp = recorded
    rewrite_options(tmp / "local.jsonl", tmp / "dump.jsonl", lambda o: o.update(instrumentation_mode="/h200/dump.so"))
    with pytest.raises(ManifestError, match=r"dump\.jsonl:1: option instrumentation_mode = '/h200/dump.so'"):
        load_record(str(tmp / "dump.jsonl"))


# --- closing recorded traffic over the specialization classes of its ints ---------------------------------------


def without_key(data: str) -> dict:
    return {k: v for k, v in json.loads(data).items() if k != "key"}  # the in-memory key: not in the disk key


def test_closing_a_recorded_request_gives_what_triton_makes_for_the_other_int_classes(recorded):
    import torch

    from prewarm.building import tritoncompat
    from prewarm.planning.plan import other_int_classes, resolve
    from prewarm_toy.kernels import add_kernel

    requests = {r.kernel.split(":")[1]: r for r in load_record(str(recorded / "local.jsonl"))}
    closed = dict(other_int_classes(resolve("prewarm_toy.kernels:add_kernel"), requests["add_kernel"].parsed, ("n",)))
    made = {}
    for what, n in (("n=1", 1), ("n other", 4097)):  # the recording ran n = 4096 (a multiple of 16)
        with tritoncompat.compile_requests(skip=True) as captured:
            add_kernel.warmup(torch.float16, torch.float16, torch.float16, n, BLOCK=256, grid=(1,))
        made[what] = without_key(captured[0])
    assert {k: without_key(v.data) for k, v in closed.items()} == made
    # decode_kernel's int is do_not_specialize: nothing to close
    decode = next(r for r in load_record(str(recorded / "local.jsonl")) if r.kernel.endswith("decode_kernel"))
    assert other_int_classes(resolve(decode.kernel), decode.parsed, ("n",)) == []


def test_a_record_entry_with_close_builds_the_added_classes(recorded):
    """``close = ["n"]`` names the int to close: the recording saw n in one class only, so ``close = true`` (what
    varied) adds nothing here."""
    path = manifest(recorded, "local.jsonl")
    path.write_text(path.read_text().replace('record = "local.jsonl"', 'record = "local.jsonl"\nclose = true'))
    assert [r.close for r in load_record(str(recorded / "local.jsonl"), close=True)] == [(), (), ()]
    path.write_text(path.read_text().replace("close = true", 'close = ["n"]'))
    report = build(path, recorded / "built-closed", workers=1, mode="offline")
    assert report.ok and (report.requests, report.count("compiled")) == (3, 5)  # 3 recorded + add_kernel n=1, n other
    assert {r.label for r in report.results if "closed" in r.label} == {
        "add_kernel [BLOCK=256 warps=4 stages=3] [closed: n=1]", "add_kernel [BLOCK=256 warps=4 stages=3] [closed: n other]"}
