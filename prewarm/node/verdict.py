"""`verify` as a verb: the installed cache's own check (:func:`prewarm.node.verify.verify`), each JIT dir given
(``jit_dirs``) checked the same way (integrity, trust, its library's factors), with ``plan`` the plan's will-hit check
(:mod:`prewarm.node.willhit`), with ``server`` where that server's process reads (:mod:`prewarm.node.serverenv`),
judged together into one frozen :class:`Verdict` carrying its exit code. The CLI only prints it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (CacheDirMismatch, FingerprintMismatch, IntegrityError, UnverifiedEntries, WillFailError,
                      WillMissError)
from .verify import VerifyReport, judge_modules, judge_plan, verify


@dataclass(frozen=True)
class Verdict:
    """What a node's cache is worth, and the exit code that says it. Precedence: the caches' own problems
    (integrity, then trust, then fingerprint, over the Triton dir and every JIT dir: ``VerifyReport.exit_code``),
    then a server process reading another dir (``CacheDirMismatch``), then planned compiles or modules that would
    miss (``WillMissError``), then compiles that would fail on this node (``WillFailError``)."""

    report: VerifyReport
    will_hit: Any = None  # prewarm.node.willhit's report, with a plan
    server_dirs: Any = None  # prewarm.node.serverenv.ServerCacheDirs, with a server
    exit_code: int = 0
    jit: dict[str, VerifyReport] = field(default_factory=dict)  # layout -> its JIT dir's own check (``jit_dirs``)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def autotune_absent(self) -> int:
        """Planned autotune results the cache lacks (those kernels benchmark on first use)."""
        return sum(not a.present for a in self.will_hit.autotune) if self.will_hit is not None else 0

    def to_json(self) -> dict:
        dirs = self.server_dirs
        return {**self.report.to_json(), "will_hit": self.will_hit.to_json() if self.will_hit is not None else None,
                "jit_verify": {layout: r.to_json() for layout, r in self.jit.items()},
                "exit_code": self.exit_code, "ok": self.ok,
                "server_cache_dirs": None if dirs is None else {**asdict(dirs), "ok": dirs.ok,
                                                                "problem": None if dirs.ok else dirs.problem()}}


def own_exit_code(reports: list[VerifyReport]) -> int:
    """The caches' own exit code over several dirs: the first of integrity, trust, fingerprint that any fails."""
    codes = {r.exit_code for r in reports}
    return next((c for c in (IntegrityError.exit_code, UnverifiedEntries.exit_code, FingerprintMismatch.exit_code)
                 if c in codes), 0)


def judge(cache_dir: str | Path | None, *, bundle=None, trusted_keys=(), require_signature: bool = False,
          allow_unverified: bool = False, check_fingerprint: bool = True, plan: str | Path | None = None,
          jit_dirs: dict[str, str] | None = None, server: str | None = None, require_autotune: bool = False,
          require_launchers: bool = False) -> Verdict:
    """Verify ``cache_dir`` (as :func:`prewarm.node.verify.verify`) and each dir of ``jit_dirs`` (layout -> the dir its
    modules were installed in: against its receipts, with the same keys and flags; a dir of another layout is an
    IntegrityError); with ``plan``, whether each planned compile and module past Triton would hit, and whether a hit
    would come from something no verified receipt covers; with ``server``, where that server's process started with
    this environment reads. ``require_autotune``: an absent planned autotune result is a miss;
    ``require_launchers``: an absent launcher module is a miss."""
    jit_dirs = dict(jit_dirs or {})
    report = verify(cache_dir, bundle=bundle, trusted_keys=trusted_keys, require_signature=require_signature,
                    allow_unverified=allow_unverified, check_fingerprint=check_fingerprint)
    jit_reports = {}
    for layout, where in jit_dirs.items():
        jr = verify(where, trusted_keys=trusted_keys, require_signature=require_signature,
                    allow_unverified=allow_unverified, check_fingerprint=check_fingerprint)
        if jr.layout != layout:
            raise IntegrityError(f"--jit-dir {layout}={where}: {jr.cache_dir} is a {jr.layout} cache dir (its "
                                 f".prewarm/layout, or none: triton), not one {layout} modules were installed in")
        jit_reports[layout] = jr
    hit = None
    if plan:
        from ..jit import library
        from .willhit import check

        hit = check(plan, report.cache_dir, jit_dirs=jit_dirs)
        judge_plan(report, hit)
        for layout, jr in jit_reports.items():
            judge_modules(jr, [j for j in hit.jit if library(j.request.library).layout == layout])
    dirs = None
    if server:
        from ..jit import for_layout
        from .serverenv import server_cache_dirs

        dirs = server_cache_dirs(server, report.cache_dir,
                                 jit_installed={for_layout(layout).name: d for layout, d in jit_dirs.items()})
    missed = hit is not None and (not hit.ok or (require_autotune and any(not a.present for a in hit.autotune))
                                  or any(a.unread for a in hit.autotune)
                                  or (require_launchers and any(not m.present for m in hit.modules)))
    will_fail = hit.will_fail if hit is not None else []
    code = own_exit_code([report, *jit_reports.values()]) or (
        CacheDirMismatch.exit_code if dirs is not None and not dirs.ok else 0) or (
        WillMissError.exit_code if missed else WillFailError.exit_code if will_fail else 0)
    return Verdict(report, hit, dirs, code, jit_reports)
