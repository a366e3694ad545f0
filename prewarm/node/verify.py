"""Check a cache dir against what was installed into it (its receipts) or against a bundle.

Trust: a receipt is only a file in the cache dir, which anyone who can write there can delete or rewrite. So each
receipt is first checked against what it stands on: the index beside it must be the one it names (its sha256) and
list exactly the entries it records (else *tampered*, naming it), and, with trusted keys (``--trust``), that index
must carry a signature by one of them (kept beside it by ``install --trust``). Each receipt records the install
history (every other install's number and index), so a deleted receipt is *missing*, named, while a later receipt
remembers it or a number below a later one is unaccounted for. An entry no receipt that holds up covers (with
``--trust``: none signed by a trusted key; a C module kept as the node built it; a key dir no receipt names) is
*unverified*: listed; a failure (UnverifiedEntries) where only signed bundles are trusted (``require_signature``) or
where a planned compile would be served from it (``judge_plan``), unless ``allow_unverified`` (device builds,
node-local compiles the operator accepts). A build's own output dir is exempt from the plan rule (today's build box).

Integrity: every listed file is hashed (group files in their relative form, since install rewrote them to
absolute paths; the entries spread over the cores by forked processes, prewarm.building.workers); files that differ (or are links, FIFOs, dirs) are *modified*, absent ones *missing*, anything
inside a listed entry that the index does not name (stray files, links, Triton's ``tmp.pid_*`` leftovers)
*unexpected*. Any group file in the cache (listed entry or not) whose children are not files of its own entry
points *outside*: Triton would read another dir's files or drop them and recompile. Where bundles share a key the
latest receipt (by sequence number) says what is installed. Key dirs no receipt names (compiled on the node) are
counted and listed as unverified (their group files judged): install merges. Fails closed: an unreadable receipt is
reported as tampered, naming it; a dir with no receipt and no ``--bundle`` has unknown integrity (IntegrityError),
except a build's own output dir (its build info says so: only its group files are checked; will-hit does the rest).
Compatibility: each fingerprint factor of the bundle(s) against this node's own, mismatches explained.
A dir of any layout (prewarm.shipping.layouts: the one it states) is checked the same way: its entries as its layout names
them, this node's factors for that layout; a receipt or ``--bundle`` of another layout is a fault, naming both.

What the server would load: the dir is also walked as its library's own lookup resolves names (``Layout.reachable``,
the rule written beside each layout: links followed, names of any length and character the library accepts), so
what prewarm's own name pattern would skip is seen too. Everything the loader could load that is not an entry (a
leaf or module dir reached through a link, a name no bundle of the layout can hold) and every other link is
*unverified*, named with the path the loader would open; an installed entry it now reaches through a link is
*modified*; names it never reads are listed as *stray*. ``judge_modules`` is the plan rule for modules past Triton: a
planned module the library's lookup would load from something unverified.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import fingerprint
from ..building import workers as workers_
from ..shipping.bundle import Entry, is_runtime_module, open_regular, read_bounded
from ..shipping.cachedir import CacheDir, Receipt, latest_owners
from ..errors import FingerprintMismatch, IntegrityError, SignatureError, UnverifiedEntries
from ..shipping.install import default_cache_dir, kept_as_built, read_bundle
from ..shipping.nodestamp import node_factors, node_fingerprint

_OTHER = "other"  # a key dir no receipt names: counted, only its group files judged


@dataclass
class _Check:
    """What verify's workers read (inherited through fork)."""

    cache: CacheDir
    tasks: list[tuple[str, Entry | None | str]]
    owners: dict[str, Receipt]


def _check_range(start: int, stop: int) -> list[tuple]:
    job: _Check = workers_.shared()
    return [_check(job, *job.tasks[i]) for i in range(start, stop)]


def _check(job: _Check, key: str, entry: Entry | None | str) -> tuple:
    if entry == _OTHER:  # counted, not judged: only a group pointing elsewhere makes Triton read another dir
        return 0, [], [], [], job.cache.entry_state(key).outside, 0, False, False
    owner = job.owners.get(key)
    files = entry.files if entry is not None else owner.files(key)
    c = job.cache.entry_state(key, files)
    layout = job.cache.layout
    if entry is not None and layout.payload:  # a JIT build's own dir against its bundle: the build's leftovers
        # (ninja files, objects), which pack left out and no loader reads, are stray there; an installed dir holds
        # none (install refuses them), so there they stay unexpected
        c.unexpected = [p for p in c.unexpected if "/" in p[len(key) + 1:] or not layout.leftovers.fullmatch(
            p[len(key) + 1:]) or not os.path.isfile(job.cache.root / p) or os.path.islink(job.cache.root / p)]
    as_built = False
    if not c.intact and is_runtime_module(files):
        recorded = files if entry is None else owner.files(key) if owner is not None else None
        if as_built := kept_as_built(files, c, recorded):
            c.modified = []  # install keeps such a module as built on the node: verify agrees with it
    return len(files), c.modified, c.missing, c.unexpected, c.outside, c.hashed, c.intact, as_built


@dataclass
class FactorRow:
    factor: str
    bundle: str
    node: str
    status: str  # "ok" | "mismatch" (blocking) | "differs" (informational) | "unchecked" (unknown on a side)
    why: str = ""


@dataclass
class Unverified:
    """An entry, or anything else the server's loader could load from, that no verified receipt covers, and why."""

    key: str  # "/"-separated under the cache dir
    why: str
    loads: str = ""  # the path the server's loader would open from it (its layout's ``loads``); "" for a link


_AS_BUILT = "a C module kept as this node built it (not the signed bytes)"


@dataclass
class VerifyReport:
    cache_dir: str
    against: list[str]  # receipt files or the bundle URL
    layout: str = "triton"  # the dir's (prewarm.shipping.layouts)
    entries: int = 0
    entries_ok: int = 0
    files: int = 0
    bytes_hashed: int = 0
    modified: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    groups_outside: list[str] = field(default_factory=list)
    other_entries: int = 0
    tampered_receipts: list[str] = field(default_factory=list)  # a receipt whose index or signature does not check
    missing_receipts: list[str] = field(default_factory=list)  # installs the history names, with no receipt
    signed: bool = False  # verified means signed by a trusted key (--trust), not only consistent
    unverified: list[Unverified] = field(default_factory=list)
    planned_unverified: list[str] = field(default_factory=list)  # "KEY (label)": planned compiles served from those
    require_signature: bool = False
    allow_unverified: bool = False
    build_output: bool = False  # a build's own output dir, no bundle installed (exempt from the plan rule)
    factors: list[FactorRow] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)  # names the server's loader never reads: listed, never failing

    @property
    def integrity_ok(self) -> bool:
        return not (self.modified or self.missing or self.unexpected or self.groups_outside
                    or self.tampered_receipts or self.missing_receipts)

    @property
    def trust_ok(self) -> bool:
        """No unverified entry where the node trusts only signed bundles, or serving a planned compile."""
        return self.allow_unverified or not (self.planned_unverified or self.require_signature and self.unverified)

    @property
    def compatible(self) -> bool:
        return all(f.status != "mismatch" for f in self.factors)

    @property
    def ok(self) -> bool:
        return self.integrity_ok and self.trust_ok and self.compatible

    @property
    def exit_code(self) -> int:
        if not self.integrity_ok:
            return IntegrityError.exit_code
        if not self.trust_ok:
            return UnverifiedEntries.exit_code
        return 0 if self.compatible else FingerprintMismatch.exit_code

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.update(ok=self.ok, integrity_ok=self.integrity_ok, trust_ok=self.trust_ok, compatible=self.compatible,
                   exit_code=self.exit_code)
        return doc


def judge_plan(report: VerifyReport, hit) -> None:
    """Name the planned compiles (``hit``: willhit's report) the cache would serve from an unverified entry: the
    kernel the plan is for, from bytes nothing vouches for. A build's own output dir is what the build compiled."""
    if report.build_output:
        return
    unverified = {u.key for u in report.unverified}
    report.planned_unverified = [f"{x.key} ({x.label})" for x in hit.results if x.hit and x.key in unverified]


def judge_modules(report: VerifyReport, lookups) -> None:
    """Name the planned modules past Triton (``lookups``: prewarm.jit ``Lookup``s in ``report``'s dir) that their
    library would load from something no verified receipt covers: native code nothing vouches for, which the
    library's own lookup picks. A build's own output dir is what the build built."""
    if report.build_output:
        return
    root = Path(report.cache_dir)
    unverified = [u.key for u in report.unverified]
    for j in lookups:
        rel = _relative(j.path, root) if j.hit and j.path else None
        if rel is not None and any(rel == k or rel.startswith(k + "/") for k in unverified):
            report.planned_unverified.append(f"{rel} ({j.request.library} {j.request.name})")


def _relative(path: str, root: Path) -> str | None:
    """``path`` under ``root`` ("/"-separated; a library's lookup may have resolved the root's own links), or None."""
    for base in (root, root.resolve()):
        try:
            return Path(path).relative_to(base).as_posix()
        except ValueError:
            continue
    return None


def _loader_faults(cache: CacheDir, unverified: dict[str, str], loads: dict[str, str]):
    """What the layout's loader could load from ``cache`` beyond its entries (``Layout.reachable``: links followed,
    names outside prewarm's form), each into ``unverified`` with why, and every link; each path the loader would open
    into ``loads``. Returns the stray names (never read by the loader), the entries' keys, and each path reached
    through a link (key -> the link)."""
    layout = cache.layout
    found, links, stray = layout.reachable(cache.root)
    for x in found:
        loads[x.key] = str(cache.root / x.loads)
        if x.link:
            unverified[x.key] = (f"{layout.reader} follows the link {x.link} and would load {loads[x.key]} through "
                                 "it: prewarm installs no link")
        elif not x.entry:
            unverified[x.key] = (f"{layout.reader} would load {loads[x.key]} from it; no {layout.name} bundle can "
                                 f"hold that name ({layout.form})")
    for key in links:
        path = cache.root / key
        what = f"a link to {os.readlink(path)}" if path.is_symlink() else "a dir verify cannot read"
        unverified[key] = f"{what}: prewarm installs no link, and {layout.reader} follows links"
    return stray, [x.key for x in found if x.entry], {x.key: x.link for x in found if x.link}


def _receipt_proof(r: Receipt, keys: dict | None) -> tuple[str | None, str]:
    """What receipt ``r`` stands on: (the trusted key id its index is signed by, or None; "" when it holds up, else
    why its entries are unverified). Its index must be the one it names and list exactly the entries (objects,
    fingerprint, manifest) it records, and with ``keys`` carry a signature: IntegrityError naming ``r`` otherwise."""
    where = f"install receipt {r.path}"
    signer, why = None, ""
    if keys is not None:
        from ..shipping.signing import MAX_SIGNATURE_BYTES, signer as signed_by

        data = r.index_bytes  # IntegrityError: unreadable, or not the index the receipt names
        sig_where = f"{where}: its signature {r.signature_path}"
        try:
            sig = read_bounded(open_regular(r.signature_path, sig_where), MAX_SIGNATURE_BYTES, sig_where)
        except FileNotFoundError:
            why = "its bundle was installed unsigned, or without --trust (no signature kept beside its receipt)"
        except OSError as e:
            raise IntegrityError(f"{sig_where} is unreadable ({e.strerror})") from None
        else:
            try:
                named, trusted = signed_by(data, sig, keys, sig_where)
            except SignatureError as e:
                raise IntegrityError(f"{e}: tampered") from None
            signer, why = (named, "") if trusted else (None, f"its bundle is signed by key {named}, not a trusted one")
    index = r.index
    listed = {e.key: e.object for e in index.entries}
    recorded = {key: obj for key, (obj, _) in r.entries.items()}
    if listed != recorded:
        differ = sum(listed[k] != recorded[k] for k in listed.keys() & recorded.keys())
        raise IntegrityError(
            f"{where} does not record what its index lists ({len(listed.keys() - recorded.keys())} entries of the "
            f"index missing, {len(recorded.keys() - listed.keys())} not in it, {differ} with other objects): edited; "
            "re-install its bundle")
    if (r.fingerprint, r.manifest, r.layout) != (index.fingerprint, index.manifest, index.layout):
        raise IntegrityError(f"{where}: its fingerprint, manifest or layout is not its index's: edited; re-install its "
                             "bundle")
    return signer, why


def _lost_receipts(cache: CacheDir, receipts: list[Receipt]) -> list[str]:
    """Installs the receipts' history names whose receipt is gone, and numbers below a receipt that kept a history
    which no receipt or history accounts for (a receipt deleted, and the history that named it edited)."""
    present = {r.digest: r for r in receipts}
    named: dict[int, tuple[str, Receipt]] = {}
    for r in receipts:
        for n, digest in r.history.items():
            if digest:
                named.setdefault(n, (digest, r))
    lost = []
    for n, (digest, by) in sorted(named.items()):
        r = present.get(digest)  # a receipt there but unreadable is reported as tampered, not as gone
        if r is None and not cache.receipt(digest).exists() or r is not None and r.seq < n:
            lost.append(f"install #{n} (index {digest}): its receipt {cache.receipt(digest)} is gone (deleted?); "
                        f"the history in install #{by.seq}'s receipt names it")
    accounted = {r.seq for r in receipts} | {n for r in receipts for n in r.history}
    top = max((r.seq for r in receipts if "history" in r.doc), default=0)
    lost += [f"install #{n}: no receipt has this number, and no receipt's history names it (a receipt deleted, and "
             f"the history edited?)" for n in range(1, top) if n not in accounted]
    return lost


def compare_factors(built: dict[str, str], node: dict[str, str] | None = None) -> list[FactorRow]:
    node = node_fingerprint() if node is None else node
    diffs = {m.factor: m for m in fingerprint.compare(built, node)}
    rows = []
    for factor in sorted(set(built) | set(node)):
        b, n = built.get(factor, fingerprint.UNKNOWN), node.get(factor, fingerprint.UNKNOWN)
        if factor in diffs:
            m = diffs[factor]
            rows.append(FactorRow(factor, m.built, m.node, "mismatch" if m.blocking else "differs", m.why))
        elif fingerprint.UNKNOWN in (b, n):
            rows.append(FactorRow(factor, b, n, "unchecked", "unknown on one side: cannot be compared"))
        else:
            rows.append(FactorRow(factor, b, n, "ok"))
    return rows


def _against_receipts(cache: CacheDir, report: VerifyReport, trusted_keys: list[str]):
    """The receipts that hold up (tampered and missing ones into ``report``): their fingerprints, each key's latest
    owner among them, and the keys they name but do not verify (key -> why)."""
    keys = None
    if trusted_keys:
        from ..shipping.signing import load_trusted

        keys = load_trusted(list(trusted_keys))
    receipts = cache.receipts(faults=report.tampered_receipts)
    report.missing_receipts = _lost_receipts(cache, receipts)
    good: list[Receipt] = []
    why: dict[int, str] = {}  # id(receipt) -> why its entries are unverified ("": they are not)
    for r in receipts:
        try:
            signer, why[id(r)] = _receipt_proof(r, keys)
        except IntegrityError as e:
            report.tampered_receipts.append(str(e))
            continue
        good.append(r)
        report.against.append(f"receipt {r.path.stem[:16]}... (install #{r.seq}"
                              + (f", signed by {signer})" if signer else ")"))
    owners = latest_owners(good)
    vouched = [r for r in good if not why[id(r)]]
    unverified = {}
    for key, owner in owners.items():
        if not why[id(owner)] and (keys is None or key not in owner.kept):
            continue
        files = set(owner.files(key))  # another signed bundle listing these very bytes vouches for them
        if not any(key in v.entries and set(v.listed(key)) == files for v in vouched):
            unverified[key] = why[id(owner)] or _AS_BUILT
    held = {id(r) for r in good}
    unverified.update((key, "its receipt is tampered") for r in receipts if id(r) not in held for key in r.entries
                      if key not in owners and (cache.root / key).is_dir())
    if not receipts and not report.tampered_receipts:
        if not cache.read_build_info():
            raise IntegrityError(
                f"{cache.root}: integrity unknown: no install receipt in {cache.receipts_dir} (and no "
                f"{cache.build_info.name}: not a build's output dir); give the bundle it came from with --bundle"
            )
        report.build_output = True
        report.against = [f"{cache.build_info.name}: a build's output, no bundle installed (group files checked)"]
    return [r.fingerprint for r in good], owners, unverified


def verify(
    cache_dir: str | os.PathLike | None = None,
    *,
    bundle: str | None = None,
    trusted_keys: list[str] = (),
    require_signature: bool = False,
    allow_unverified: bool = False,
    storage_options: dict | None = None,
    check_fingerprint: bool = True,
    workers: int | None = None,
) -> VerifyReport:
    """Integrity of ``cache_dir`` against its install receipts (or ``bundle``), what each receipt stands on (with
    ``trusted_keys``: a signature), and compatibility with this node."""
    cache_dir = Path(os.path.abspath(cache_dir or default_cache_dir()))
    cache = CacheDir(cache_dir)
    if not cache_dir.is_dir():
        raise IntegrityError(f"{cache_dir}: cache dir does not exist or is not a directory")
    report = VerifyReport(str(cache_dir), [], cache.layout.name, signed=bool(trusted_keys),
                          require_signature=require_signature, allow_unverified=allow_unverified)
    unverified: dict[str, str] = {}  # key -> why
    if bundle:
        b = read_bundle(
            bundle, trusted_keys=trusted_keys, require_signature=require_signature, storage_options=storage_options
        )  # with keys: signed by one of them, or a SignatureError
        if b.layout is not cache.layout:
            raise IntegrityError(f"{bundle} is a {b.layout.name} bundle, {cache_dir} a {cache.layout.name} cache dir "
                                 f"({cache.layout_file}): not what was installed there")
        fingerprints = [b.index.fingerprint]
        report.against = [bundle + (f" (signed by {b.signed_by})" if b.signed_by else "")]
        owners = latest_owners(cache.receipts(strict=False))  # runtime-built modules kept by install
        checks = [(e.key, e) for e in b.index.entries]
        outside_why = "not in the bundle (compiled on this node, or copied in)"
    else:
        if require_signature and not trusted_keys:
            raise SignatureError(f"{cache_dir}: a signature is required but no trusted public key was given (--trust)")
        fingerprints, owners, unverified = _against_receipts(cache, report, trusted_keys)
        checks = [(key, None) for key in owners]
        outside_why = "a build's output (build-info.json), no bundle installed" if report.build_output else (
            "no receipt names it (compiled on this node, or copied in)")
        for r in {id(r): r for r in owners.values()}.values():
            r.read_index()  # once, here, before the workers fork
    report.entries = len(checks)
    checked = {key for key, _ in checks}
    loads: dict[str, str] = {}
    # the dir as the server's loader reads it: its entries, and what else it would load (each unverified)
    report.stray, entries, linked = _loader_faults(cache, unverified, loads)
    others = [key for key in entries if key not in checked]
    report.other_entries = len(others)
    where = cache.layout.loads != "{key}"  # a module file in it, named: what the library would load
    unverified.update((key, outside_why + (f"; {cache.layout.reader} would load {loads[key]}" if where else ""))
                      for key in others if key not in unverified)  # tampered: said so already
    # every file hashed, spread over the cores by processes (threads share one core for the per-file Python)
    tasks = checks + [(key, _OTHER) for key in others]
    processes = len(tasks) >= 64 and workers != 1 and workers_.can_fork()
    n = workers or workers_.cores()
    state = _Check(cache, tasks, owners)
    step = max(1, min(256, len(tasks) // (n * 16)))
    results = workers_.run(_check_range, workers_.ranges(len(tasks), step), state, processes=processes,
                           workers=n if processes else 1)
    for (key, _), (key_files, modified, missing, unexpected, outside, hashed, intact, as_built) in zip(
            tasks, (x for chunk in results for x in chunk)):
        report.modified += modified
        report.missing += missing
        report.unexpected += unexpected
        report.groups_outside += outside
        report.bytes_hashed += hashed
        report.files += key_files
        report.entries_ok += intact
        if as_built and trusted_keys:
            unverified.setdefault(key, _AS_BUILT)
    # an installed entry the loader now reaches through a link is not where install put it, whatever its bytes
    report.modified += [f"{key} (reached through a link: {linked[key]})" for key in sorted(checked & linked.keys())]
    report.unverified = [Unverified(key, unverified[key], loads.get(key, "")) for key in sorted(unverified)]
    if check_fingerprint:
        seen: list[dict] = []
        node = node_factors(cache.layout, cache.meta)[0]
        for fp in fingerprints:
            if fp not in seen:
                seen.append(fp)
                report.factors += compare_factors(fp, node)
        # A dir filled under another Ascend toolchain would be reused silently (not in Triton's key).
        for m in cache.toolchain_conflicts(node):
            report.factors.append(FactorRow(m.factor, m.built, m.node, "mismatch", m.why))
    return report
