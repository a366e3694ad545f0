"""verify anchors trust in the signed index, not in receipts anyone who can write the cache dir can delete or forge
(issue 43). Every verdict through the real CLI; the bundles are packed and signed once for the module, each test
works on its own copy of an installed node.

The node: the toy bundle (real Triton entries, install #1), then a second bundle (install #2), both signed and
installed with --trust. The signed mode is what deploy/prelaunch.sh runs with PREWARM_TRUST set:
`verify --trust KEY --require-signature`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prewarm.shipping.bundle import INDEX, SIGNATURE
from prewarm.shipping.cachedir import META, CacheDir
from prewarm.errors import IntegrityError, SignatureError, StoreError, UnverifiedEntries
from prewarm.shipping.install import install
from prewarm.shipping.pack import pack
from prewarm.shipping.signing import keygen

from prewarm_helpers import FIXTURES, REPO, copy_cache, run_cli, synthetic_cache

ADD_ONLY = """name = "toy-add"
[target]
backend = "cuda"
arch = "sm_90"
[[kernels]]
function = "prewarm_toy.kernels:add_kernel"
label = "add"
args = { x_ptr = { tensor = "float32" }, y_ptr = { tensor = "float32" }, out_ptr = { tensor = "float32" }, n = 1000, BLOCK = [64, 256] }
options = { num_warps = 4 }
"""


@pytest.fixture(scope="module")
def world(toy_cache_master, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trust")
    _, pub, _ = keygen(root / "signer")
    _, other_pub, _ = keygen(root / "stranger")
    pack(copy_cache(toy_cache_master, root / "toy-build"), root / "toy", signing_key=root / "signer.key")
    pack(synthetic_cache(root / "second-build", 3, seed=43), root / "second", signing_key=root / "signer.key")
    pack(synthetic_cache(root / "unsigned-build", 2, seed=44), root / "unsigned")
    node = root / "node"
    for name in ("toy", "second"):
        install(str(root / name), node, trusted_keys=[str(pub)], durable=False)
    (root / "add.toml").write_text(ADD_ONLY)
    return {"root": root, "pub": pub, "stranger": other_pub, "node": node, "toy": root / "toy",
            "second": root / "second", "unsigned": root / "unsigned", "plan": root / "add.toml"}


@pytest.fixture
def node(world, tmp_path) -> Path:
    """A private copy of the installed node (group files rewritten for where it is now)."""
    return copy_cache(world["node"], tmp_path / "node")


def signed_mode(world) -> list[str]:
    return ["--trust", str(world["pub"]), "--require-signature"]


def verify_json(node: Path, *flags: str, code: int, env: dict | None = None) -> dict:
    """verify's one JSON document (compatibility skipped: these nodes are this host's own; the pre-launch test runs
    the whole check)."""
    return json.loads(run_cli("verify", "--cache-dir", node, "--json", "--no-fingerprint", *flags, check=code,
                              env=env).stdout)


def receipt_of(node: Path, bundle: Path) -> Path:
    return CacheDir(node).receipt(hashlib.sha256((bundle / INDEX).read_bytes()).hexdigest())


def rewrite_receipt(path: Path, edit) -> None:
    """What someone who read cachedir.py can do: edit a receipt and recompute its checksum."""
    doc = json.loads(path.read_bytes())
    edit(doc)
    doc.pop("checksum")
    data = json.dumps({"checksum": "0" * 64, **doc}, sort_keys=False, separators=(",", ":")).encode()
    path.write_bytes(data.replace(b"0" * 64, hashlib.sha256(data).hexdigest().encode(), 1))


def toy_keys(world) -> list[str]:
    return sorted(e["key"] for e in json.loads((world["toy"] / INDEX).read_bytes())["entries"])


def flip_a_byte(entry: Path) -> Path:
    cubin = next(entry.glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    return cubin


# --- a clean node ---------------------------------------------------------------------------------------------


def test_a_clean_node_verifies_clean_with_trust_and_in_signed_mode(world, node):
    for flags in ([], ["--trust", str(world["pub"])], signed_mode(world)):
        doc = verify_json(node, *flags, code=0)
        assert doc["unverified"] == [] and doc["tampered_receipts"] == [] and doc["missing_receipts"] == []
    assert doc["signed"] and all("signed by" in a for a in doc["against"]) and len(doc["against"]) == 2
    out = run_cli("verify", "--cache-dir", node, "--no-fingerprint", *signed_mode(world)).stdout
    assert "trust         ok      verified: listed by an index a trusted key signed" in out
    assert out.rstrip().endswith("clean")


# --- (a) a deleted receipt ------------------------------------------------------------------------------------


def test_two_bundles_an_entry_flipped_and_its_receipt_deleted_is_named(world, node):
    """The issue's run: was exit 0 ("5 other entries ... clean")."""
    key = toy_keys(world)[0]
    flip_a_byte(node / key)
    receipt = receipt_of(node, world["toy"])
    receipt.unlink()
    for flags in ([], ["--trust", str(world["pub"])], signed_mode(world)):
        doc = verify_json(node, *flags, code=IntegrityError.exit_code)
        assert [m for m in doc["missing_receipts"] if m.startswith("install #1 ") and str(receipt) in m], doc
        assert key in {u["key"] for u in doc["unverified"]}  # its entries: no receipt covers them now
    p = run_cli("verify", "--cache-dir", node, "--no-fingerprint", *signed_mode(world), check=IntegrityError.exit_code)
    assert f"missing receipt: install #1 (index {receipt.stem})" in p.stdout and f"unverified: {key}" in p.stdout


def test_the_latest_receipt_deleted_is_caught_only_where_signatures_are_required(world, node):
    """No later receipt remembers the last install: by default its entries are listed as unverified; the signed
    mode fails them (exit 13), each named."""
    receipt_of(node, world["second"]).unlink()
    doc = verify_json(node, code=0)
    second = sorted(u["key"] for u in doc["unverified"])
    assert len(second) == 3 and not doc["missing_receipts"]
    doc = verify_json(node, *signed_mode(world), code=UnverifiedEntries.exit_code)
    assert sorted(u["key"] for u in doc["unverified"]) == second
    p = run_cli("verify", "--cache-dir", node, "--no-fingerprint", *signed_mode(world),
                check=UnverifiedEntries.exit_code)
    assert all(f"unverified: {k}: no receipt names it" in p.stdout for k in second), p.stdout


# --- (b) a forged receipt, (c) an edited index ----------------------------------------------------------------


def test_a_receipt_with_its_entries_emptied_and_its_checksum_recomputed_is_tampered(world, node):
    receipt = receipt_of(node, world["toy"])
    rewrite_receipt(receipt, lambda doc: doc.update(entries={}))
    flip_a_byte(node / toy_keys(world)[1])  # what the forged receipt was to hide
    for flags in ([], signed_mode(world)):
        doc = verify_json(node, *flags, code=IntegrityError.exit_code)
        (tampered,) = doc["tampered_receipts"]
        assert str(receipt) in tampered and "does not record what its index lists (5 entries of the index missing" \
            in tampered


def test_a_receipts_stored_index_edited_is_tampered(world, node):
    index = receipt_of(node, world["toy"]).with_suffix(".index")
    index.write_bytes(index.read_bytes().replace(b'"size":', b'"size": ', 1))
    for flags in ([], signed_mode(world)):
        doc = verify_json(node, *flags, code=IntegrityError.exit_code)
        (tampered,) = doc["tampered_receipts"]
        assert str(index) in tampered and "does not hold index" in tampered


def test_a_whole_install_re_forged_is_caught_by_its_signature(world, tmp_path):
    """The limit without --trust, and what --trust adds: the only install's cubin replaced, its index re-listed
    (checksum recomputed), the index, signature and receipt renamed to the new digest and the receipt's checksum
    recomputed. Consistent: verify without keys cannot tell; the signature no longer verifies."""
    node = tmp_path / "node"
    install(str(world["toy"]), node, trusted_keys=[str(world["pub"])], durable=False)
    old = receipt_of(node, world["toy"])
    cubin = next((node / toy_keys(world)[0]).glob("*.cubin"))
    before = hashlib.sha256(cubin.read_bytes()).hexdigest()
    flip_a_byte(cubin.parent)
    data = old.with_suffix(".index").read_bytes()
    data = data.replace(before.encode(), hashlib.sha256(cubin.read_bytes()).hexdigest().encode())
    body = data[data.index(b'"entries"'):]
    data = b'{"checksum":"' + hashlib.sha256(b"{" + body).hexdigest().encode() + b'",' + body
    new = CacheDir(node).receipt(hashlib.sha256(data).hexdigest())
    new.with_suffix(".index").write_bytes(data)
    old.with_suffix(".sig").rename(new.with_suffix(".sig"))
    old.rename(new)
    old.with_suffix(".index").unlink()
    rewrite_receipt(new, lambda doc: doc.update(index_digest=new.stem))
    verify_json(node, code=0)  # consistent: only a key can tell
    doc = verify_json(node, "--trust", str(world["pub"]), code=IntegrityError.exit_code)
    (tampered,) = doc["tampered_receipts"]
    assert str(new) in tampered and "does not verify" in tampered


def test_a_signature_by_a_key_not_trusted_leaves_the_entries_unverified(world, node):
    doc = verify_json(node, "--trust", str(world["stranger"]), code=0)
    assert len(doc["unverified"]) == 8 and all("not a trusted one" in u["why"] for u in doc["unverified"])
    verify_json(node, "--trust", str(world["stranger"]), "--require-signature", code=UnverifiedEntries.exit_code)


# --- (d) a receipt number missing -----------------------------------------------------------------------------


def test_a_receipt_deleted_and_the_history_naming_it_edited_leaves_its_number_missing(world, node):
    receipt_of(node, world["toy"]).unlink()
    rewrite_receipt(receipt_of(node, world["second"]), lambda doc: doc.update(history={}))
    for flags in ([], signed_mode(world)):
        doc = verify_json(node, *flags, code=IntegrityError.exit_code)
        (missing,) = doc["missing_receipts"]
        assert missing.startswith("install #1: no receipt has this number"), missing


def test_a_re_installed_bundle_moves_to_a_new_number_without_a_false_alarm(world, node):
    """A later install claimed no key of the first, but re-installing the first after its receipt is deleted
    gives it a new number: the history accounts for the old one."""
    receipt_of(node, world["toy"]).unlink()
    install(str(world["toy"]), node, trusted_keys=[str(world["pub"])], durable=False)
    assert sorted(r.seq for r in CacheDir(node).receipts()) == [2, 3]
    verify_json(node, *signed_mode(world), code=0)


# --- unverified entries: device builds, node-local compiles, unsigned bundles ---------------------------------


def test_device_built_entries_fail_the_signed_mode_unless_allowed(world, node):
    """Entries a device build (or the runtime) wrote into the node: no receipt covers them."""
    before = set(os.listdir(node))
    built = sorted(set(os.listdir(synthetic_cache(node, 2, seed=45))) - before)
    doc = verify_json(node, code=0)  # by default: listed, not failed
    assert [u["key"] for u in doc["unverified"]] == built
    doc = verify_json(node, *signed_mode(world), code=UnverifiedEntries.exit_code)
    assert [u["key"] for u in doc["unverified"]] == built and not doc["trust_ok"]
    doc = verify_json(node, *signed_mode(world), "--allow-unverified", code=0)
    assert [u["key"] for u in doc["unverified"]] == built and doc["ok"]


def test_key_dirs_triton_would_read_through_a_link_are_refused(world, node, tmp_path):
    """Triton's cache manager reads ``<dir>/<key>/`` through any link (issue 57): a key dir linked in is unverified
    (exit 13 in signed mode, the link named), an installed one moved behind a link is modified (exit 6), a stray file
    Triton never reads is only listed."""
    elsewhere = synthetic_cache(tmp_path / "elsewhere", 1, seed=46)
    [planted] = os.listdir(elsewhere)
    (node / planted).symlink_to(elsewhere / planted)
    (node / "lost+found").mkdir()
    doc = verify_json(node, code=0)
    assert [u["key"] for u in doc["unverified"]] == [planted] and doc["stray"] == ["lost+found"]
    doc = verify_json(node, *signed_mode(world), code=UnverifiedEntries.exit_code)
    [u] = doc["unverified"]
    assert u["why"].startswith(f"Triton's cache manager follows the link {planted} -> {elsewhere / planted}"), u
    (node / planted).unlink()
    key = toy_keys(world)[0]
    (node / key).rename(tmp_path / key)
    (node / key).symlink_to(tmp_path / key)  # the same bytes, now behind a link
    doc = verify_json(node, *signed_mode(world), code=IntegrityError.exit_code)
    assert doc["modified"] == [f"{key} (reached through a link: {key} -> {tmp_path / key})"]
    assert [u["key"] for u in doc["unverified"]] == [key]


def test_link_cycles_end_at_the_loaders_depth(tmp_path):
    """``Layout.reachable`` follows links only as deep as the loader looks: each cycle is reported, never walked on."""
    from prewarm.shipping import layouts

    root = tmp_path / "jit"
    layouts.mark(root, "sglang-jit")
    module = root / "sm90a" / "sgl_kernel_jit_x"
    module.mkdir(parents=True)
    (module / "build-0123456789abcdef").symlink_to(module)  # followed (a build dir's name), back to its parent
    (root / "sm90a" / "sgl_kernel_jit_y").symlink_to(root / "sm90a")  # followed, back to the target dir
    (module / "deps-0123456789abcdef").symlink_to(root)  # not where a leaf is, but a leaf through the build link
    found, links, stray = layouts.get("sglang-jit").reachable(root)
    leaf = "sm90a/sgl_kernel_jit_x/build-0123456789abcdef/deps-0123456789abcdef"
    assert [(x.key, x.link) for x in found] == [(leaf, f"sm90a/sgl_kernel_jit_x/build-0123456789abcdef -> {module}")]
    assert links == ["sm90a/sgl_kernel_jit_x/build-0123456789abcdef", "sm90a/sgl_kernel_jit_x/deps-0123456789abcdef",
                     "sm90a/sgl_kernel_jit_y"] and stray == []


def test_an_unsigned_bundle_is_unverified_under_trust(world, node):
    install(str(world["unsigned"]), node, durable=False)
    doc = verify_json(node, "--trust", str(world["pub"]), code=0)
    assert len(doc["unverified"]) == 2 and all("installed unsigned" in u["why"] for u in doc["unverified"])
    verify_json(node, *signed_mode(world), code=UnverifiedEntries.exit_code)
    verify_json(node, code=0)  # without --trust a receipt that holds up covers its entries


def test_a_repeated_install_with_trust_keeps_the_signature_an_earlier_one_did_not(world, tmp_path):
    node = tmp_path / "node"
    install(str(world["second"]), node, durable=False)
    doc = verify_json(node, *signed_mode(world), code=UnverifiedEntries.exit_code)
    assert len(doc["unverified"]) == 3 and all("without --trust" in u["why"] for u in doc["unverified"])
    assert install(str(world["second"]), node, trusted_keys=[str(world["pub"])], durable=False).noop
    verify_json(node, *signed_mode(world), code=0)


def test_a_planned_compile_served_from_an_entry_no_receipt_covers_fails(world, tmp_path):
    """The toy kernels copied into a node that installed another bundle: every planned compile hits, but from bytes
    no receipt vouches for (exit 13 naming them); --allow-unverified accepts them."""
    node = copy_cache(world["root"] / "toy-build", tmp_path / "node")
    install(str(world["second"]), node, durable=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    doc = verify_json(node, "--plan", world["plan"], code=UnverifiedEntries.exit_code, env=env)
    assert doc["will_hit"]["hits"] == 2 and len(doc["planned_unverified"]) == 2
    assert {p.split()[0] for p in doc["planned_unverified"]} <= set(toy_keys(world))
    doc = verify_json(node, "--plan", world["plan"], "--allow-unverified", code=0, env=env)
    assert doc["planned_unverified"] and doc["ok"]


def test_the_prelaunch_signed_mode_keeps_the_server_down_on_a_tampered_node(world, node):
    """deploy/prelaunch.sh with PREWARM_TRUST: install (a no-op here) then verify in signed mode; the first
    bundle's receipt deleted and an entry of it flipped: exit 6, the server not started."""
    flip_a_byte(node / toy_keys(world)[0])
    receipt_of(node, world["toy"]).unlink()
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "PREWARM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", TRITON_CACHE_DIR=str(node), PREWARM_SOURCE=str(world["second"]),
               PREWARM_TRUST=str(world["pub"]), PREWARM_MANIFEST=str(world["plan"]), PREWARM_GUARD="off",
               PYTHONPATH=str(FIXTURES))
    p = subprocess.run(["/bin/sh", str(REPO / "deploy" / "prelaunch.sh"), "echo", "server-started"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == IntegrityError.exit_code, p.stdout + p.stderr
    assert "missing receipt: install #1" in p.stdout and "server-started" not in p.stdout


# --- exit codes: a signature's faults are 7, a store's are 10 ------------------------------------------------


def test_a_signature_over_64_kib_is_a_signature_error(world, tmp_path):
    bundle = shutil.copytree(world["toy"], tmp_path / "b")
    sig = bundle / SIGNATURE
    sig.write_bytes(sig.read_bytes().rstrip(b"\n") + b" " * (64 << 10) + b"\n")
    p = run_cli("install", bundle, "--cache-dir", tmp_path / "node", "--trust", world["pub"],
                check=SignatureError.exit_code)
    assert f"{sig}: larger than 65536 bytes" in p.stderr and not (tmp_path / "node" / META / "receipts").exists()


@pytest.mark.parametrize("make", ["dir", "fifo"])
def test_an_index_that_is_a_dir_or_fifo_in_a_store_is_a_store_error(world, tmp_path, make):
    bundle = shutil.copytree(world["second"], tmp_path / "b")
    (bundle / INDEX).unlink()
    (bundle / INDEX).mkdir() if make == "dir" else os.mkfifo(bundle / INDEX)
    for args in (["install", f"file://{bundle}", "--cache-dir", tmp_path / "node"],
                 ["verify", "--cache-dir", world["node"], "--bundle", bundle]):
        p = run_cli(*args, check=StoreError.exit_code)
        assert f"{bundle / INDEX}: not a regular file" in p.stderr
