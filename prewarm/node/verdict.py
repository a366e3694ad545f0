"""`verify` as a verb: the installed cache's own check (:func:`prewarm.node.verify.verify`), with ``plan`` the
plan's will-hit check (:mod:`prewarm.node.willhit`), with ``server`` where that server's process reads
(:mod:`prewarm.node.serverenv`), judged together into one frozen :class:`Verdict` carrying its exit code. The CLI
only prints it."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheDirMismatch, WillFailError, WillMissError
from .verify import VerifyReport, judge_plan, verify


@dataclass(frozen=True)
class Verdict:
    """What a node's cache is worth, and the exit code that says it. Precedence: the cache's own problems (integrity,
    trust, fingerprint: ``report.exit_code``), then a server process reading another dir (``CacheDirMismatch``), then
    planned compiles that would miss (``WillMissError``), then compiles that would fail on this node
    (``WillFailError``)."""

    report: VerifyReport
    will_hit: Any = None  # prewarm.node.willhit's report, with a plan
    server_dirs: Any = None  # prewarm.node.serverenv.ServerCacheDirs, with a server
    exit_code: int = 0

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
                "exit_code": self.exit_code, "ok": self.ok,
                "server_cache_dirs": None if dirs is None else {**asdict(dirs), "ok": dirs.ok,
                                                                "problem": None if dirs.ok else dirs.problem()}}


def judge(cache_dir: str | Path | None, *, bundle=None, trusted_keys=(), require_signature: bool = False,
          allow_unverified: bool = False, check_fingerprint: bool = True, plan: str | Path | None = None,
          jit_dirs: dict[str, str] | None = None, server: str | None = None, require_autotune: bool = False,
          require_launchers: bool = False) -> Verdict:
    """Verify ``cache_dir`` (as :func:`prewarm.node.verify.verify`); with ``plan``, whether each planned compile and
    module past Triton would hit (``jit_dirs``: layout -> the dir its modules were installed in); with ``server``,
    where that server's process started with this environment reads. ``require_autotune``: an absent planned
    autotune result is a miss; ``require_launchers``: an absent launcher module is a miss."""
    jit_dirs = dict(jit_dirs or {})
    report = verify(cache_dir, bundle=bundle, trusted_keys=trusted_keys, require_signature=require_signature,
                    allow_unverified=allow_unverified, check_fingerprint=check_fingerprint)
    hit = None
    if plan:
        from .willhit import check

        hit = check(plan, report.cache_dir, jit_dirs=jit_dirs)
        judge_plan(report, hit)
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
    code = report.exit_code or (CacheDirMismatch.exit_code if dirs is not None and not dirs.ok else 0) or (
        WillMissError.exit_code if missed else WillFailError.exit_code if will_fail else 0)
    return Verdict(report, hit, dirs, code)
