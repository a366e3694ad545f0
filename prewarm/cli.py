"""The `prewarm` command: a thin shell over the library. Each verb parses, calls one stage, formats the result.

People get rich tables and progress on stderr/stdout; machines get ``--json`` (one JSON document on stdout).
Errors are PrewarmError subclasses: their message goes to stderr and their exit code is returned.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.markup import escape

from . import __version__
from .errors import PrewarmError, StoreError, WillFailError, WillMissError

# Piped into a job's log, rich would wrap every line at 80 columns, splitting the error and result lines operators
# grep for: there, a message stays one line and a table as wide as its cells (COLUMNS, when set, still wins).
LOG_WIDTH = 4096


def _console(stderr: bool = False) -> Console:
    """A rich console for stdout or stderr: as rich makes it on a terminal, unwrapped when it is not one."""
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.soft_wrap = True
        if "COLUMNS" not in os.environ:
            console.width = LOG_WIDTH
    return console


out = _console()
err = _console(stderr=True)

USAGE = """\
Compile the Triton kernels a server will launch before it starts, ship that cache to every node, and prove
before serving that no rank will compile.

  manifest --plan--> requests --build--> cache dir --pack--> bundle --push--> store(s)
  on each node: store --install--> TRITON_CACHE_DIR, then verify (integrity, toolchain, will-hit)

Start with `prewarm plan MANIFEST` (what will be compiled), then `prewarm build MANIFEST --cache-dir DIR`.
`prewarm VERB --help` describes a verb; README.md walks through the whole pipeline and every exit code."""


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def progress_bar(args):
    """A rich progress display on stderr for people; nothing with --json or when stderr is not a terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, disable=args.json or not err.is_terminal)


# --- verbs ---------------------------------------------------------------------------------------------------
# (each cmd_* returns the process exit code)


def cmd_plan(args) -> int:
    from rich.table import Table

    from .building.autotune import autotuned_kernels
    from .building.backends import npu
    from .planning.manifest import load
    from .planning.plan import Plan, coverage as component_coverage

    m = load(args.manifest)
    with npu.prints_to_stderr():  # triton-ascend prints advice to stdout at every bind
        plans = _plans(m, args)
    if args.compiles:
        return _print_compiles(plans, args)
    docs = []
    for planned, why in plans:  # one per SoC of a multi-SoC npu manifest
        p = Plan(planned.manifest, planned.requests, planned.jit)
        coverage = _table_coverage(planned.manifest, p.requests, args) if why is None else None
        tuned = autotuned_kernels(planned.requests, planned.pins) if why is None else []
        if args.json:
            docs.append({**p.to_json(), "counts": _counts_json(planned, why),
                         "autotune": coverage.to_json() if coverage is not None else None,
                         "autotuned_kernels": [k.to_json() for k in tuned],
                         "will_fail": [w.to_json() for w in planned.will_fail],
                         "coverage": component_coverage(planned)})
            continue
        pm = p.manifest
        t = Table(title=f"{pm.name}: {len(p.requests)} requests for {pm.backend} {pm.arch}")
        for c in ("#", "id", "label", "kernel", "arguments"):
            t.add_column(c, overflow="fold")
        for i, r in enumerate(p.requests, 1):
            t.add_row(str(i), r.ident, escape(r.label), r.kernel, escape(r.describe()))
        out.print(t)
        _print_counts(planned, why)
        _print_options(pm)
        _print_table_coverage(coverage)
        _print_pins(tuned, planned.pins)
        _print_jit(planned.jit)
        _print_will_fail(planned.will_fail)
        _print_coverage(component_coverage(planned))
    if args.json:
        emit_json(docs[0] if len(docs) == 1 else {"manifest": str(m.path), "socs": docs})
    else:
        out.print("autotuned kernels compile once per config: `prewarm plan --compiles` lists Triton's own requests")
    return _will_fail_exit([w for planned, _ in plans for w in planned.will_fail], args)


def _print_jit(jit) -> None:
    """The modules past Triton the plan builds with their library's own code (prewarm.jit), one line each."""
    for j in jit:
        out.print(f"jit module: {escape(j.library)} {escape(j.name)} (reached by {escape(j.origin or 'the plan')})",
                  highlight=False)


def _print_coverage(entries) -> None:
    """One line per model component of each manifest entry (plan.coverage): its planned kernels and compiles, the
    will-fail ones among them, then each kernel the model reaches that the plan does not, with why."""
    for e in entries:
        for c in e["components"]:
            compiles = "not counted" if c["compiles"] is None else str(c["compiles"])
            failing = f", {len(c['will_fail'])} will-fail" if c["will_fail"] else ""
            missing = f", {len(c['not_planned'])} not planned" if c["not_planned"] else ""
            n = len(c["kernels"])
            out.print(f"component {escape(e['provider'])} [bold]{escape(c['component'])}[/]: {n} "
                      f"kernel{'s' * (n != 1)} planned, {compiles} compiles{failing}{missing}", highlight=False)
            for item in c["not_planned"]:
                out.print(f"  [yellow]not planned[/] {escape(item['what'])}: {escape(item['why'])}", highlight=False)
            for ref in c["unreached"]:
                out.print(f"  [red]unreached[/] {escape(ref)}: the provider says it plans it, no launch reached it",
                          highlight=False)


def _print_will_fail(will_fail) -> None:
    """Each planned kernel this Triton cannot key (plan.WillFail): kernel, file:line and reason on one line, then
    what the node does, the fix and the requests that reach it. Plan, lower, build and verify print the same rows."""
    for w in will_fail:
        out.print(f"[red]will-fail[/] {escape(w.kernel)} ({escape(w.file)}:{w.line}): {escape(w.triton)} cannot key "
                  f"it: {escape(w.error)}: {escape(w.reason)}", highlight=False)
        labels = [r.label for r in w.requests]
        out.print(f"  node: {escape(w.node)}\n  fix: {escape(w.fix)}\n  {len(labels)} planned requests reach it: "
                  + escape(", ".join(labels[:3]) + (", ... (--json has all)" if len(labels) > 3 else "")),
                  highlight=False)


def _will_fail_exit(will_fail, args) -> int:
    """After a verb's report: exit 12 where a planned kernel will fail (an error line naming each; --json: the code
    alone, its one document lists them), else 0."""
    if not will_fail:
        return 0
    if args.json:
        return WillFailError.exit_code
    kernels = list(dict.fromkeys(will_fail))  # one per kernel (a multi-SoC plan lists each per SoC)
    names = "; ".join(f"{w.kernel} ({w.file}:{w.line}): {w.error}: {w.reason}" for w in kernels)
    raise WillFailError(f"{len(kernels)} planned kernel(s) cannot be keyed by this Triton: a node running it crashes "
                        f"at its first call of each (listed above with the fix): {names}")


def _plans(m, args) -> list:
    """(Planned, why not expanded) for each target `plan` expands the manifest under (backends.plan_targets: every
    SoC of an npu manifest, no node needed). Without --compiles, a target that cannot be activated here (an npu
    manifest outside triton-ascend) still lists its requests, with why its compiles are not counted."""
    from .building import backends
    from .errors import EnvironmentProblem
    from .planning.plan import Planned, plan, plan_for

    out = []
    for manifest, target in backends.plan_targets(m, args.mode):
        try:
            target.activate()
        except EnvironmentProblem as e:
            if args.compiles:
                raise
            backends.activate_for_planning(manifest)
            out.append((Planned(manifest, target, plan(manifest).requests, []), str(e)))
            continue
        out.append((plan_for(manifest, target), None))
    return out


def _counts_json(planned, why: str | None) -> dict:
    if why is not None:
        return {"requests": len(planned.requests), "compiles": None, "why_not_counted": why}
    return {"requests": len(planned.requests), "compiles": len(planned.compiles),
            "closing": sum(bool(c.closing) for c in planned.compiles), "target": planned.target.describe(),
            "by_kernel": [c.to_json() for c in planned.counts()]}


def _print_counts(planned, why: str | None) -> None:
    """What a build of this plan compiles, before anything is built: requests, compiles, what closing added."""
    if why is not None:
        out.print(f"{len(planned.requests)} requests; compiles not counted here: {escape(why)}", highlight=False)
        return
    counts = planned.counts()
    closing = sum(c.closing for c in counts)
    out.print(f"{len(planned.requests)} requests -> [bold]{len(planned.compiles)} compiles[/] for "
              f"{planned.target.describe()}" + (f" ({closing} added by closing)" if closing else ""), highlight=False)
    for c in [c for c in counts if c.closing][:5]:
        out.print(f"  closing: {escape(c.source)}: {escape(c.kernel.rsplit(':', 1)[-1])} {c.requests} requests -> "
                  f"{c.compiles} compiles (+{c.closing})", highlight=False)


def _print_options(m) -> None:
    """Every API axis a provider plans on fewer values than its library accepts, and who narrowed it; every
    parameter it does not plan, and why; every server geometry value it planned with (a row's ``derived``: what the
    value is and how to read it off a live server)."""
    from .planning.plan import provider_options

    for source, rows in provider_options(m).items():
        for r in (r for r in rows if r.get("derived")):
            out.print(f"derived: {escape(source)}: {r['key']} = {escape(json.dumps(r['planned']))} "
                      f"({'set in the manifest' if r['given'] else 'the provider derived it'}): "
                      f"{escape(r['derived'])}", highlight=False)
        for r in (r for r in rows if r["narrowed"]):
            if r.get("why"):
                out.print(f"not planned: {escape(source)}: {r['key']}: {escape(r['why'])}", highlight=False)
                continue
            who = "set in the manifest" if r["given"] else "the provider's default"
            out.print(f"narrowed: {escape(source)}: {r['key']} = {escape(json.dumps(r['planned']))} ({who}; the "
                      f"library accepts {escape(json.dumps(r['accepted']))})", highlight=False)


def _table_coverage(m, requests, args):
    """The plan's tuning keys against the manifest's autotune table (or --tuned), nothing written; None: no table.
    The target must be active."""
    from .building import autotune
    from .planning.plan import manifest_device_name

    table = autotune.table_path(m, args.tuned)
    if table is None:
        return None
    device = manifest_device_name(m, "--tuned" if args.tuned else "target.tuned")
    return autotune.apply_table(table, device, autotune.planned_tunings(requests), None, str(m.path))


def _print_table_coverage(coverage) -> None:
    """The autotune line of plan and build, then each planned tuning key the table does not cover."""
    if coverage is None:
        return
    out.print(("[green]" if not coverage.uncovered else "[yellow]") + escape(coverage.summary()) + "[/]",
              highlight=False)
    rows = [] if coverage.missing_file else coverage.uncovered  # no file: the summary says it for every key
    for r in rows[:20]:
        out.print(f"[yellow]{r.status}[/] {escape(r.tuning.label)} ({escape(r.tuning.kernel.rsplit(':', 1)[-1])}) "
                  f"tuning key {escape(r.tuning.tuning_key or '-')}: {escape(r.detail)}", highlight=False)
    if len(rows) > 20:
        out.print(f"[yellow]...[/] {len(rows) - 20} more (--json has all)")


def _print_pins(tuned, pins) -> None:
    """Each pinned kernel the plan narrows to its one config, each autotuned kernel a node would benchmark in every
    process (no pin, and a Triton that keeps no results), and each pin naming no planned kernel: never silent."""
    for k in tuned:
        if k.pin is not None or not k.keeps:
            colour = "[green]pinned[/]" if k.pin is not None else "[yellow]benchmarks[/]"
            out.print(f"{colour} {escape(k.kernel)}: {escape(k.describe())}", highlight=False)
    for kernel in sorted(set(pins) - {k.kernel for k in tuned}):
        out.print(f"[yellow]pin unused[/] {escape(kernel)}: the autotune table pins it, the plan does not call it",
                  highlight=False)


def _print_compiles(plans, args) -> int:
    """The plan expanded into Triton's own compile requests for the manifest's target (one per autotune config),
    and every recorded request whose key this host does not reproduce (prewarm.building.keys; exit 8)."""
    from rich.table import Table

    from .building import keys
    from .building.backends import npu
    from .errors import FingerprintMismatch
    from .planning.plan import Plan

    with npu.prints_to_stderr():
        drifts = [keys.check(planned.requests, planned.compiles) for planned, _ in plans]
    docs, drifted = [], sum(map(len, drifts))
    for (planned, _), drift in zip(plans, drifts):
        m, target, compiles = planned.manifest, planned.target, planned.compiles
        p = Plan(m, planned.requests)
        if args.json:
            docs.append({**p.to_json(), "target_mode": target.mode, "compiles": [c.to_json() for c in compiles],
                         "counts": _counts_json(planned, None), "key_drift": [d.to_json() for d in drift],
                         "will_fail": [w.to_json() for w in planned.will_fail]})
            continue
        t = Table(title=f"{m.name}: {len(compiles)} compiles from {len(p.requests)} requests for {target.describe()}")
        for c in ("#", "request", "label", "kernel"):
            t.add_column(c, overflow="fold")
        for i, c in enumerate(compiles, 1):
            t.add_row(str(i), c.request, escape(c.label), c.kernel)
        out.print(t)
        _print_counts(planned, None)
        for d in drift:
            out.print(f"[red]key drift[/] {escape(d.label)}: {escape(d.summary())}", highlight=False)
        _print_will_fail(planned.will_fail)
    code = FingerprintMismatch.exit_code if drifted else 0
    if args.json:
        emit_json(docs[0] if len(docs) == 1 else {"socs": docs})
    elif drifted:
        err.print(f"[bold red]error[/]: {drifted} recorded requests would not be found by the recording's node: "
                  f"this host computes other cache keys (each part named above); a build refuses them unless "
                  f"--allow-key-drift", highlight=False)
    return code or _will_fail_exit([w for planned, _ in plans for w in planned.will_fail], args)


def cmd_build(args) -> int:
    from rich.table import Table

    from .building.build import build
    from .errors import BuildError

    with progress_bar(args) as bar:
        task = bar.add_task("building", total=None)

        def progress(result, done, total):
            bar.update(task, completed=done, total=total, description=f"{result.status:>8} {result.label[:60]}")

        r = build(args.manifest, args.cache_dir, workers=args.workers, mode=args.mode, progress=progress,
                  tuned=args.tuned, max_compiles=args.max_compiles, allow_key_drift=args.allow_key_drift)
    if args.json:
        emit_json(r.to_json())
    else:
        for note in r.notes:
            err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
        for d in r.key_drift:
            err.print(f"[yellow]key drift (allowed)[/] {escape(d.label)}: {escape(d.summary())}", highlight=False)
        if r.autotune is not None and not r.autotune.missing_file:
            for x in r.autotune.uncovered[:20]:
                err.print(f"[yellow]{x.status}[/] {escape(x.tuning.label)} "
                          f"({escape(x.tuning.kernel.rsplit(':', 1)[-1])}) tuning key "
                          f"{escape(x.tuning.tuning_key or '-')}: {escape(x.detail)}", highlight=False)
        for f in r.failed:
            t = Table(title=f"[red]failed[/] {escape(f.label)} ({f.kernel})", show_header=False)
            t.add_row(escape(f.message))
            out.print(t)
        _print_will_fail(r.will_fail)
        out.print(f"{r.manifest} -> {r.cache_dir} ({r.target}, {r.workers} workers): {r.requests} requests, "
                  f"{len(r.results)} compiles: [green]{r.count('compiled')} compiled[/], "
                  f"{r.count('present')} already present, "
                  f"{'[red]' if r.failed else ''}{len(r.failed)} failed{'[/]' if r.failed else ''}"
                  + (f", [red]{len(r.will_fail)} kernels will fail[/] (cannot be keyed: not built)" if r.will_fail
                     else "")
                  + f" in {r.seconds:.1f} s")
        from .jit import library

        for layout, where in r.jit_dirs.items():
            built = [j for j in r.jit if j.hit and library(j.request.library).layout == layout]
            out.print(f"{layout}: {len(built)} modules past Triton -> {escape(where)} (pack it as its own bundle)",
                      highlight=False)
        for j in r.jit_failed:
            out.print(f"[red]jit module failed[/] {escape(j.request.library)} {escape(j.request.name)}: "
                      f"{escape(j.reason)}", highlight=False)
    if (r.failed or r.jit_failed) and args.json:
        return BuildError.exit_code  # the report above is the one JSON document
    if r.failed:
        raise BuildError(f"{len(r.failed)} of {len(r.results)} compiles failed (first: {r.failed[0].label}: "
                         f"{r.failed[0].message.splitlines()[0] if r.failed[0].message else 'no message'})")
    if r.jit_failed:
        j = r.jit_failed[0]
        raise BuildError(f"{len(r.jit_failed)} of {len(r.jit)} modules past Triton were not built (first: "
                         f"{j.request.library} {j.request.name}: {j.reason})")
    return _will_fail_exit(r.will_fail, args)


def cmd_tune(args) -> int:
    from .building.tune import tune

    r = tune(args.manifest, args.output, workers=args.workers, work_dir=args.work_dir, cache_dir=args.cache_dir)
    if args.json:
        emit_json(r.to_json())
        return 0
    for note in r.notes:
        err.print(f"[yellow]note[/]: {escape(note)}", highlight=False)
    for x in r.not_measured:
        err.print(f"[yellow]not measured[/] {escape(x.tuning.label)} ({escape(x.tuning.kernel.rsplit(':', 1)[-1])}) "
                  f"tuning key {escape(x.tuning.tuning_key or '-')}: {escape(x.detail)}", highlight=False)
    out.print(f"{r.manifest}: {len(r.rows)} tuning keys measured on {escape(r.device)}"
              + (f", {len(r.not_measured)} not measured" if r.not_measured else "")
              + f" in {r.seconds:.1f} s -> {escape(r.output)}")
    return 0


def cmd_record(args) -> int:
    from .planning.record import record

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    r = record(args.output, command)
    if args.json:
        emit_json(r.to_json())
    else:
        err.print(f"recorded {r.lines} compile requests ({r.unique} distinct) into {r.output}; "
                  f"the command exited with {r.returncode}", highlight=False)
    return r.returncode


def cmd_pack(args) -> int:
    from .shipping.pack import pack

    r = pack(args.cache_dir, args.output, signing_key=args.sign, sequence=args.sequence)
    if args.json:
        emit_json({"bundle": str(r.bundle_dir), "index_digest": r.index.digest, "layout": r.index.layout,
                   "entries": len(r.index.entries),
                   "objects_written": r.objects_written, "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
                   "signed": bool(args.sign), "skipped": r.skipped, "sequence": r.index.sequence,
                   "left_out": r.left_out})
        return 0
    out.print(f"packed {len(r.index.entries)} entries ({r.bytes_in / 1e6:.1f} MB -> {r.bytes_out / 1e6:.1f} MB, "
              f"{r.objects_written} new objects) into {r.bundle_dir}" + (" [signed]" if args.sign else "")
              + (f" ({r.index.layout} layout)" if r.index.layout != "triton" else ""))
    out.print(f"index sha256 {r.index.digest}, sequence {r.index.sequence}")
    for name in r.skipped:
        err.print(f"[yellow]skipped[/] {name}: not a cache entry dir")
    if r.left_out:
        err.print(f"[yellow]left out[/] {len(r.left_out)} build leftovers no loader reads (e.g. "
                  f"{escape(r.left_out[0])})", highlight=False)
    return 0


def cmd_push(args) -> int:
    from rich.table import Table

    from .shipping.stores import push

    with progress_bar(args) as bar:
        tasks = {}  # one bar per target; progress() is called from the push threads, rich's Progress is thread-safe

        def progress(url, done, total):
            if url not in tasks:
                tasks[url] = bar.add_task(f"push {escape(url)}", total=total)
            bar.update(tasks[url], completed=done, total=total)

        results = push(args.bundle, args.urls, attempts=args.retries + 1, progress=progress,
                       verify_remote=args.verify_remote)
    failed = [r for r in results if not r.ok]
    if args.json:
        emit_json({"ok": not failed, "targets": [vars(r) for r in results]})
    else:
        t = Table(title=f"push {args.bundle}")
        t.add_column("target", overflow="fold")
        for c in ("result", "sent", "already there", "MB sent", "retries", "seconds"):
            t.add_column(c)
        for r in results:
            t.add_row(r.url, "[green]ok[/]" if r.ok else f"[red]FAILED[/] {escape(str(r.error))}", str(r.sent), str(r.present),
                      f"{r.bytes_sent / 1e6:.1f}", str(r.retries), f"{r.seconds:.1f}")
        out.print(t)
    return StoreError.exit_code if failed else 0


def cmd_install(args) -> int:
    from .shipping.install import install
    from .shipping.layouts import NoNodeDir

    with progress_bar(args) as bar:
        task = bar.add_task("install (fetch, check, stage)", total=None)
        try:
            r = install(args.source, args.cache_dir, trusted_keys=args.trust, require_signature=args.require_signature,
                        allow_fingerprint_mismatch=args.allow_fingerprint_mismatch,
                        allow_missing_factors=args.allow_missing_factors, workers=args.workers,
                        lock_timeout=args.lock_timeout, recheck=args.recheck, allow_downgrade=args.allow_downgrade,
                        progress=lambda done, total: bar.update(task, completed=done, total=total))
        except NoNodeDir as e:  # known once the bundle is read: the usage error argparse gives a missing option
            args.usage_error(f"{args.source}: {e}")
    if args.json:
        doc = {k: v for k, v in vars(r).items() if k != "mismatches"}
        doc["mismatches"] = [vars(m) for m in r.mismatches]
        emit_json(doc)
        return 0
    for m in r.mismatches:
        err.print(f"[yellow]{'overridden' if m.blocking else 'note'}[/]: {m}", highlight=False)
    if r.noop:
        out.print(f"{r.cache_dir}: already installed ({r.entries} entries), nothing to do")
    else:
        out.print(f"{r.cache_dir}: installed {r.installed} entries ({r.bytes_fetched / 1e6:.1f} MB fetched), "
                  f"{r.present} already present"
                  + (f" ({r.kept} C modules as built here, kept)" if r.kept else "")
                  + f", {r.replaced} replaced, in {r.seconds:.2f} s"
                  + (f"; signed by {r.signed_by}" if r.signed_by else ""))
    return 0


def cmd_verify(args) -> int:
    from .node.verdict import judge

    v = judge(args.cache_dir, bundle=args.bundle, trusted_keys=args.trust, require_signature=args.require_signature,
              allow_unverified=args.allow_unverified, check_fingerprint=not args.no_fingerprint, plan=args.plan,
              jit_dirs=dict(args.jit_dir), server=args.server, require_autotune=args.require_autotune,
              require_launchers=args.require_launchers)
    if args.json:
        emit_json(v.to_json())
        return v.exit_code
    (_print_verify_tables if args.details else _print_verify_summary)(v.report, v.will_hit, args)
    for jr in v.jit.values():  # each --jit-dir: its own integrity, trust and factors, as the Triton dir's
        (_print_verify_tables if args.details else _print_verify_summary)(jr, None, argparse.Namespace(plan=None))
    _print_server_dirs(v.server_dirs)
    absent = v.autotune_absent
    note = f" ({absent} autotune results absent: those kernels benchmark on first use)" if absent and v.ok else ""
    out.print(("[green]clean[/]" if v.ok else f"[red]problems found[/] (exit {v.exit_code})") + note)
    return v.exit_code


def _layout_dir(pair: str) -> tuple[str, str]:
    """``--jit-dir LAYOUT=DIR`` -> (layout, dir); argparse's usage error otherwise."""
    from .shipping.layouts import known

    layout, sep, where = pair.partition("=")
    if not sep or layout not in known() or layout == "triton" or not where:
        raise argparse.ArgumentTypeError(f"{pair!r}: expected LAYOUT=DIR with LAYOUT one of "
                                         f"{', '.join(k for k in known() if k != 'triton')}")
    return layout, where


def _print_server_dirs(dirs) -> None:
    """`verify --server`: where a server process would read Triton's cache; the variable to set when not here."""
    from .node.serverenv import VARIABLE

    if dirs is None:
        return
    out.print(f"{'server dirs':<14}" + ("[green]ok[/]      " + escape(dirs.summary()) if dirs.ok else
                                       "[red]PROBLEM[/] " + escape(dirs.problem())), highlight=False)
    moved = ", ".join(f"{k}={v}" for k, v in sorted(dirs.set_by_import.items()) if k != VARIABLE)
    if moved:
        out.print(f"{'':<14}[yellow]info[/]    " + escape(f"`import {dirs.server}` also set {moved} (not checked: "
                                                           "a bundle holds Triton's cache only)"), highlight=False)


def _print_verify_summary(r, hit, args) -> None:
    """One line per check, then only what is wrong (with why), then what is informational: one screen for a clean
    cache; `--details` has every row."""
    ok, bad, info = "[green]ok[/]      ", "[red]PROBLEM[/] ", "[yellow]info[/]    "

    def line(check: str, status: str, text: str) -> None:
        out.print(f"{check:<14}{status}{escape(text)}", highlight=False)

    against = ", ".join(r.against) or "no install receipt: group files only"
    out.print(f"verify {escape(r.cache_dir)} (against {escape(against)})", highlight=False)
    line("integrity", ok if r.integrity_ok else bad,
         f"{r.entries_ok}/{r.entries} entries, {r.files} files, {r.bytes_hashed / 1e6:.1f} MB hashed; "
         f"{r.other_entries} other entries (not from a bundle)")
    line("trust", bad if not r.trust_ok else ok if r.signed and not r.unverified else info, _trust_text(r))
    if r.factors:
        mismatch = [f for f in r.factors if f.status == "mismatch"]
        differs = [f.factor for f in r.factors if f.status == "differs"]
        unchecked = [f.factor for f in r.factors if f.status == "unchecked"]
        text = f"{len(r.factors) - len(mismatch) - len(differs) - len(unchecked)} of {len(r.factors)} factors match"
        text += "".join(f"; {what}: {', '.join(names)}" for what, names in
                        (("differs (informational)", differs), ("unchecked", unchecked)) if names)
        version = next((f for f in mismatch if f.factor == "triton.version"), None)
        if version is not None:  # every key differs: said first, with both
            text = f"built with Triton {version.bundle}, this node runs Triton {version.node}; " + text
        line("compatibility", bad if mismatch else ok, text)
    if args.plan:
        from .building import tritoncompat
        from .planning.manifest import load

        other = tritoncompat.differs_from(load(args.plan).triton, f"{args.plan} ([target] triton)")
        if other:
            line("triton", info, f"{other}: its tuned table and the server it plans are that Triton's")
    if hit is not None:
        # each line's status is that of what it counts (a missing JIT module is the jit line's PROBLEM, not this one's)
        line("will-hit", ok if not hit.misses else bad,
             f"{hit.hits}/{len(hit.results)} planned compiles hit ({hit.target})")
        if hit.will_fail:
            line("will-fail", bad, f"{len(hit.will_fail)} planned kernels this Triton cannot key "
                                   f"({sum(len(w.requests) for w in hit.will_fail)} requests): the node crashes at "
                                   f"its first call of each, whatever the cache holds")
        if hit.key_drift:
            line("recorded keys", info, f"{len(hit.key_drift)} recorded requests keyed otherwise here than in the "
                                        f"process that recorded them (each part named in their rows)")
        if hit.autotune:
            kept = sum(a.present for a in hit.autotune)
            unread = sum(a.unread for a in hit.autotune)
            pinned = sum(bool(a.pinned) for a in hit.autotune)
            status = ok if kept == len(hit.autotune) else (bad if args.require_autotune else info)
            line("autotune", bad if unread else status, f"{kept - pinned} kept, "
                 + (f"{pinned} kernels pinned (the guard runs their config alone), " if pinned else "")
                 + f"{len(hit.autotune) - kept} absent"
                 + (f", {unread} kept but not read in this environment (TRITON_CACHE_AUTOTUNING unset)" if unread
                    else "")
                 + ("" if args.require_autotune or kept == len(hit.autotune) else
                    " (absent: benchmarked on first use; --require-autotune makes it fail)"))
        if hit.jit:
            line("jit modules", bad if hit.jit_misses else ok,
                 f"{len(hit.jit) - len(hit.jit_misses)}/{len(hit.jit)} modules past Triton found by their library's "
                 f"own lookup (" + ", ".join(f"{k} {v}" for k, v in hit.jit_dirs.items()) + ")")
            for j in hit.jit_misses:
                line("", bad, f"{j.request.library} {j.request.name}: {j.reason}")
        if hit.modules:
            have = sum(m.present for m in hit.modules)
            line("C modules", ok if have == len(hit.modules) else (bad if args.require_launchers else info),
                 f"{have} of {len(hit.modules)} in the cache ({_modules_text(hit)})")
    # each unverified entry where it fails or keys were given; else the trust line's count (--json has them all)
    unverified = [f"{u.key}: {u.why}" for u in r.unverified] if r.signed or not r.trust_ok else []
    for name, items, style in (("tampered receipt", r.tampered_receipts, "red"),
                               ("missing receipt", r.missing_receipts, "red"),
                               ("modified", r.modified, "red"), ("missing", r.missing, "red"),
                               ("unexpected", r.unexpected, "red"), ("group pointing outside", r.groups_outside, "red"),
                               ("planned compile from an unverified entry", r.planned_unverified, "red"),
                               ("unverified", unverified, "yellow" if r.trust_ok else "red"),
                               ("stray (the server's loader never reads it)", r.stray, "yellow")):
        for item in items[:20]:
            out.print(f"[{style}]{name}[/]: {escape(item)}", highlight=False)
        if len(items) > 20:
            out.print(f"[{style}]{name}[/]: ... {len(items) - 20} more (--json has all)")
    for f in r.factors:
        if f.status == "mismatch":
            out.print(f"[red]mismatch[/] {f.factor}: bundle {escape(f.bundle)}, node {escape(f.node)}: "
                      f"{escape(f.why)}", highlight=False)
    if hit is None:
        return
    _print_will_fail(hit.will_fail)
    for x in hit.results:
        if not x.hit:
            out.print(f"[red]MISS[/] {escape(x.label)} ({escape(x.kernel.rsplit(':', 1)[-1])}) key {x.key or '-'}: "
                      f"{escape(x.detail)}", highlight=False)
    for d in hit.key_drift:
        if hit.results[d.compile_index].hit:
            out.print(f"[yellow]hit, keyed otherwise when recorded[/] {escape(d.label)}: {escape(d.summary())}",
                      highlight=False)
    for a in hit.autotune:
        if (not a.present and args.require_autotune) or a.unread:
            out.print(f"[red]autotune {'unread' if a.unread else 'absent'}[/] {escape(a.label)} "
                      f"({escape(a.kernel.rsplit(':', 1)[-1])}) key {a.key}: {escape(a.detail)}", highlight=False)
    for m in hit.modules:
        if not m.present:
            users = f"{m.kernels} planned compiles" if m.name != "cuda_utils" else "every kernel"
            out.print(f"{'[red]' if args.require_launchers else '[yellow]'}absent[/] {m.name} {m.key} (used by {users}): the node builds it with its C compiler "
                      f"at first launch, about a second, no kernel compile{f'; {escape(m.detail)}' if m.detail else ''}",
                      highlight=False)


def _modules_text(hit) -> str:
    """What verify's C modules count covers on this node's runtime."""
    if hit.target.startswith("npu"):
        return "a launcher per kernel signature, npu_utils and the precompiled header"
    from .building import tritoncompat

    release = tritoncompat.release()
    if release.cuda_launchers == "per-signature":
        return "a launcher per kernel signature, and cuda_utils"
    return f"cuda_utils, whose launch serves every kernel: {release} builds no launcher per kernel signature"


def _trust_text(r) -> str:
    """verify's trust line: what a verified receipt means here, how many entries none covers, what fails them."""
    text = ("verified: listed by an index a trusted key signed (--trust)" if r.signed else
            "verified: listed by --bundle or by an index that matches its receipt (without --trust nothing proves "
            "who wrote it)")
    if not r.unverified:
        return text + "; every entry verified"
    text += f"; {len(r.unverified)} entries unverified"
    if r.planned_unverified:
        text += f", {len(r.planned_unverified)} planned compiles would be served from them"
    if r.allow_unverified:
        return text + " (allowed: --allow-unverified)"
    return text + ("" if not r.trust_ok else
                   " (listed; they fail with --require-signature, or when a planned compile would come from one)")


def _print_verify_tables(r, hit, args) -> None:
    """Every row of every check (`verify --details`)."""
    from rich.table import Table

    against = ", ".join(r.against) or "no install receipt: only group files checked; will-hit below"
    t = Table(title=f"integrity of {r.cache_dir} (against {against})")
    t.add_column("check", overflow="fold")  # folded, never cut: a path or key must be findable
    t.add_column("count", justify="right")
    t.add_column("files", overflow="fold")
    t.add_row("entries ok", f"{r.entries_ok}/{r.entries}", f"{r.files} files, {r.bytes_hashed / 1e6:.1f} MB hashed")
    for name, items in (("modified", r.modified), ("missing", r.missing), ("unexpected", r.unexpected),
                        ("groups pointing outside", r.groups_outside)):
        t.add_row(f"[red]{name}[/]" if items else name, str(len(items)),
                  escape("\n".join(items[:20])) + (f"\n... {len(items) - 20} more" if len(items) > 20 else ""))
    t.add_row("other entries (not from a bundle)", str(r.other_entries), "")
    for name, items in (("tampered receipts", r.tampered_receipts), ("missing receipts", r.missing_receipts),
                        ("unverified entries", [f"{u.key}: {u.why}" for u in r.unverified]),
                        ("planned, from unverified entries", r.planned_unverified),
                        ("stray (the server's loader never reads it)", r.stray)):
        more = f"\n... {len(items) - 20} more" if len(items) > 20 else ""
        t.add_row(f"[red]{name}[/]" if items and (name != "unverified entries" or not r.trust_ok) else name,
                  str(len(items)), escape("\n".join(items[:20])) + more)
    out.print(t)
    out.print(escape(f"trust: {_trust_text(r)}"), highlight=False)
    if r.factors:
        t = Table(title="compatibility (bundle fingerprint vs this node)")
        for c in ("factor", "bundle", "node", "status", "why"):
            t.add_column(c)
        style = {"ok": "green", "mismatch": "bold red", "differs": "yellow", "unchecked": "dim"}
        for f in r.factors:
            t.add_row(f.factor, escape(f.bundle), escape(f.node), f"[{style[f.status]}]{f.status}[/]", escape(f.why))
        out.print(t)
    if hit is not None:
        t = Table(title=f"will-hit ({hit.hits} hits, {hit.misses} misses)")
        for c in ("label", "kernel", "key", "hit", "detail"):  # folded, never cut: a miss must be findable
            t.add_column(c, overflow="fold")
        for x in hit.results:  # the kernel's function name; --json has the full module:function reference
            t.add_row(escape(x.label), escape(x.kernel.rsplit(":", 1)[-1]), x.key or "-",
                      "[green]hit[/]" if x.hit else "[red]MISS[/]", escape(x.detail))
        out.print(t)
        _print_will_fail(hit.will_fail)
        if hit.jit:
            t = Table(title=f"modules past Triton ({len(hit.jit) - len(hit.jit_misses)} found, "
                            f"{len(hit.jit_misses)} the node would build)")
            for c in ("library", "module", "found", "where / why"):
                t.add_column(c, overflow="fold")
            for j in hit.jit:
                t.add_row(j.request.library, escape(j.request.name), "[green]hit[/]" if j.hit else "[red]MISS[/]",
                          escape(j.path if j.hit else j.reason))
            out.print(t)
        if hit.autotune:
            kept = sum(a.present for a in hit.autotune)
            absent = "[red]absent[/]" if args.require_autotune else "[yellow]absent[/]"
            t = Table(title=f"autotune results ({kept} kept, {len(hit.autotune) - kept} absent"
                            + ("" if args.require_autotune else "; informational without --require-autotune") + ")")
            for c in ("first call", "kernel", "key", "kept", "detail"):
                t.add_column(c, overflow="fold")
            for a in hit.autotune:
                t.add_row(escape(a.label), escape(a.kernel.rsplit(":", 1)[-1]), a.key,
                          ("[green]pinned[/]" if a.pinned else "[green]kept[/]") if a.present else absent,
                          escape(a.detail))
            out.print(t)
        if hit.modules:
            have = sum(m.present for m in hit.modules)
            out.print(f"C modules the runtime builds at first launch: {have} of {len(hit.modules)} in the cache "
                      f"({_modules_text(hit)})")
            missing = [m for m in hit.modules if not m.present]
            if missing:
                t = Table(title="[yellow]absent[/]: the node builds these with its C compiler at first launch (about "
                                "a second each, no kernel compile; fails where no compiler is installed)")
                for c in ("module", "key", "planned compiles using it", "detail"):
                    t.add_column(c, overflow="fold")
                for m in missing:
                    t.add_row(m.name, m.key, str(m.kernels) if m.name != "cuda_utils" else "all", escape(m.detail))
                out.print(t)


def cmd_ls(args) -> int:
    from rich.table import Table

    from .shipping.install import default_cache_dir
    from .shipping.scan import scan

    r = scan(args.cache_dir or default_cache_dir())
    if args.json:
        emit_json(r.to_json())
        return 0
    t = Table(title=f"bundles installed in {escape(r.cache_dir)}"
                    + (f" ({r.layout} layout)" if r.layout != "triton" else ""))
    for c in ("manifest", "manifest digest", "installed", "entries", "MB", "signed by", "from"):
        t.add_column(c, overflow="fold")
    for b in r.bundles:
        entries = f"{b.entries_present}/{b.entries}" if b.entries_present != b.entries else str(b.entries)
        t.add_row(escape(b.manifest or "-"), b.manifest_digest[:16] or "-", b.installed_at, entries,
                  f"{b.bytes / 1e6:.1f}", escape(b.signed_by or "-"), escape(b.source))
    out.print(t)
    mb = sum(e.bytes for e in r.other_entries) / 1e6
    out.print(f"{len(r.other_entries)} entries no bundle installed ({mb:.1f} MB: compiled on this node or copied in)"
              + (": " + ", ".join(e.key for e in r.other_entries[:5]) if r.other_entries else "")
              + (f" ... (--json lists all {len(r.other_entries)})" if len(r.other_entries) > 5 else ""))
    if r.toolchain:
        out.print("Ascend toolchain claim: " + escape(", ".join(f"{k}={v}" for k, v in sorted(r.toolchain.items()))))
    return 0


def cmd_explain(args) -> int:
    import os

    from .building import backends
    from .node.explain import explain_path
    from .planning.manifest import load
    from .planning.plan import plan_for
    from .building.probe import planned_keys

    planned = plan_for(*backends.select(load(args.plan), args.mode))
    keys = planned_keys(planned.compiles) if os.path.isdir(args.source) else {}
    rows = explain_path(args.source, planned.compiles, keys)
    missing = sum(not e.planned for _, e in rows)
    code = WillMissError.exit_code if missing else 0
    if args.json:
        emit_json({"source": args.source, "plan": planned.manifest.name, "target": planned.target.describe(),
                   "requests": [{"label": label, **e.to_json()} for label, e in rows],
                   "planned": len(rows) - missing, "not_planned": missing, "exit_code": code})
        return code
    for label, e in rows:
        if e.planned:
            out.print(f"[green]planned[/]     {escape(label)} = {escape(e.nearest.label)}", highlight=False)
            continue
        out.print(f"[red]NOT PLANNED[/] {escape(label)}", highlight=False)
        for line in str(e).splitlines():
            out.print(f"    {escape(line)}", highlight=False)
    out.print(f"{len(rows)} runtime requests: {len(rows) - missing} planned, "
              f"{f'[red]{missing} not planned[/]' if missing else '0 not planned'} ({planned.manifest.name}, "
              f"{planned.target.describe()})", highlight=False)
    return code


def cmd_guard(args) -> int:
    """Replace this process with the command, its Python processes guarded (see prewarm.node.guard)."""
    import os

    from .node import guard, metrics
    from .errors import EnvironmentProblem, ManifestError
    from .planning.record import hooked_pythonpath

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ManifestError("guard: no command given: expected `prewarm guard [--mode warn|error] -- COMMAND ...`")
    env = dict(os.environ)
    for name, value in ((guard.MODE, args.mode), (guard.RECORD, args.record), (guard.PLAN, args.plan),
                        (guard.ARM, args.arm), (metrics.TEXTFILE, args.metrics_textfile)):
        if value:
            env[name] = os.path.abspath(value) if name in (guard.RECORD, guard.PLAN, metrics.TEXTFILE) else value
    env.setdefault(guard.MODE, "warn")
    env["PYTHONPATH"] = hooked_pythonpath()
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise EnvironmentProblem(f"guard: cannot run {command[0]!r}: {e.strerror}") from e


def cmd_keygen(args) -> int:
    from .shipping.signing import keygen

    priv, pub, kid = keygen(args.output, force=args.force)
    if args.json:
        emit_json({"private_key": str(priv), "public_key": str(pub), "key_id": kid})
    else:
        out.print(f"key {kid}: private {priv} (keep it secret; `prewarm pack --sign {priv}`), "
                  f"public {pub} (give it to nodes: `prewarm install --trust {pub}`)")
    return 0


def cmd_fingerprint(args) -> int:
    from rich.table import Table

    from .node.fingerprint import current

    fp = current(args.backend, args.arch)
    if args.json:
        emit_json(fp)
        return 0
    t = Table(title="this environment's fingerprint")
    t.add_column("factor")
    t.add_column("value")
    for k, v in sorted(fp.items()):
        t.add_row(k, escape(v))
    out.print(t)
    return 0


def cmd_manifest(args) -> int:
    from rich.table import Table

    from .planning.manifestgen import generate, write

    gen = generate(args.model, args.server, args.kernels, args.target, args.server_args, name=args.name)
    path = write(gen, args.output) if args.output else None
    if args.json:
        emit_json({**gen.to_json(), "output": str(path) if path else None, "manifest": gen.toml()})
        return 0
    for words in gen.ignored:
        err.print(f"[yellow]ignored[/] {escape(words)}", highlight=False)
    if path is None:
        sys.stdout.write(gen.toml())
        return 0
    t = Table(title=f"{path}: {gen.name} (a {gen.server} launch line, --kernels {gen.kernels})")
    for c in ("key", "value", "from"):
        t.add_column(c, overflow="fold")
    for table, keys in gen.spec.items():
        for key, v in keys.items():
            t.add_row(f"spec.{table}.{key}", escape(str(v.value)), escape(v.source))
    out.print(t)
    for note in gen.notes:
        out.print(f"note: {escape(note)}", highlight=False)
    out.print(f"`prewarm plan {escape(str(path))}` lists its requests", highlight=False)
    return 0


def cmd_lower(args) -> int:
    from rich.table import Table

    from .errors import BuildError
    from .building.lower import STAGES, lower
    from .planning.manifest import load

    r = lower(load(args.manifest))
    if args.json:  # one document: the report says what failed; the exit code says that something did
        emit_json(r.to_json())
        return BuildError.exit_code if r.failed else _will_fail_exit(r.will_fail, args)
    t = Table(title=f"{r.manifest}: front end ({r.triton}) for npu {r.arch}")
    for c in ("#", "kernel", "variant", *(f"{s} ms" for s in STAGES), f"UB KB (of {r.ub_size // 1024})",
              "cache key / error"):
        t.add_column(c, overflow="fold")
    for i, c in enumerate(r.compiles, 1):
        ms = [f"{c.stage_ms[s]:.1f}" if s in c.stage_ms else ("[red]failed[/]" if s == c.failed_stage else "")
              for s in STAGES]
        ub = "" if c.ub_bytes is None else f"{c.ub_bytes / 1024:.0f}"
        t.add_row(str(i), c.kernel, escape(c.label), *ms, f"[red]{ub}[/]" if c.failed_stage == "ub" else ub,
                  c.cache_key if c.ok else f"[red]{c.failed_stage}[/]: {escape(c.error)}")
    out.print(t)
    _print_will_fail(r.will_fail)
    peak = max((c.ub_bytes for c in r.compiles if c.ub_bytes is not None), default=0)
    will_fail = f", [red]{len(r.will_fail)} kernels will fail[/] (cannot be keyed: not lowered)" if r.will_fail else ""
    out.print(f"{r.lowered} of {len(r.compiles)} compiles ({r.requests} requests) lowered to linalg"
              f"{f', [red]{len(r.failed)} failed[/]' if r.failed else ''}{will_fail}; largest UB estimate "
              f"{peak / 1024:.0f} KB of {r.ub_size // 1024} KB")
    crashed = [c for c in r.compiles if c.crashed and c.ok]
    if crashed:
        out.print(f"[yellow]warning[/]: {len(crashed)} compile(s) crashed the front end once and lowered on retry "
                  f"(a flaky {r.triton} tool; a node's JIT may crash the same way): "
                  + "; ".join(f"{c.kernel} {escape(c.label)}: {escape(c.crashed)}" for c in crashed))
    for warning in r.warnings:  # a fixed-config kernel over the UB estimate: unconfirmed, not a failure
        out.print(f"[yellow]warning[/]: {escape(warning)}", highlight=False)
    if r.failed:
        raise BuildError(f"{len(r.failed)} of {len(r.compiles)} compiles failed in the front end: "
                         + "; ".join(c.failure() for c in r.failed))
    return _will_fail_exit(r.will_fail, args)


# --- parser --------------------------------------------------------------------------------------------------


def _number(kind: type, lo: float, hi: float):
    """An argparse type: a ``kind`` number within [lo, hi] (no negative worker counts, no endless lock waits)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not lo <= value <= hi:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"{text} is out of range ({lo} to {hi})")
        return value

    return parse


class _ArgsAfterDashes(argparse.ArgumentParser):
    """A verb whose words after ``--`` are another program's arguments (``server_args``), kept whole: argparse
    would match them against its own positionals, and cannot after an option and a positional."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        tail = args[args.index("--") + 1:] if "--" in args else []
        namespace, extras = super().parse_known_args(args[:len(args) - len(tail) - ("--" in args)], namespace)
        namespace.server_args = tail
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    from .planning.manifestgen import kernel_choices
    from .providers import servers
    from .node.serverenv import server_imports

    p = argparse.ArgumentParser(prog="prewarm", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"prewarm {__version__}")
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name, fn, help):
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("--json", action="store_true", help="print one JSON document for machines")
        sp.set_defaults(func=fn)
        return sp

    sp = verb("plan", cmd_plan, "list the exact compile requests a manifest makes")
    sp.add_argument("manifest")
    sp.add_argument("--compiles", action="store_true",
                    help="expand each request into Triton's compiles for the target (one per autotune config)")
    sp.add_argument("--mode", choices=("offline", "device", "auto"), default="auto",
                    help="the target driver to expand under (as for build; npu: every SoC offline unless device)")
    sp.add_argument("--tuned", metavar="TABLE", help="the autotune table to check the plan's tuning keys against "
                                                    "(default: the manifest's [target] tuned)")

    sp = verb("build", cmd_build, "compile a manifest's requests into a Triton cache dir")
    sp.add_argument("manifest")
    sp.add_argument("--cache-dir", required=True)
    sp.add_argument("--workers", type=_number(int, 1, 1024), default=None, help="compile processes (default: CPU count)")
    sp.add_argument("--mode", choices=("offline", "device", "auto"), default="auto",
                    help="offline: no accelerator (target-only driver); device: compile and run once on it")
    sp.add_argument("--tuned", metavar="TABLE", help="write the autotune results of this table (made by `prewarm "
                                                    "tune`) for every planned tuning key it covers (default: the "
                                                    "manifest's [target] tuned)")
    sp.add_argument("--max-compiles", type=_number(int, 0, 10**9), metavar="N",
                    help="refuse (exit 3) a plan of more than N compiles before compiling anything")
    sp.add_argument("--allow-key-drift", action="store_true",
                    help="build even where this host computes other cache keys than a recording's process did (the "
                         "recording's node would not find those kernels; default: refuse, exit 8)")

    sp = verb("tune", cmd_tune, "benchmark every planned autotune key once on this machine's device and write the "
                                "winners to a table that builds ship (run on one node of the target device)")
    sp.add_argument("manifest")
    sp.add_argument("-o", "--output", required=True, metavar="TABLE",
                    help="the table (TOML) to write; its rows for other devices are kept")
    sp.add_argument("--workers", type=_number(int, 1, 1024), default=None,
                    help="compile processes of the scratch device build (default: CPU count)")
    sp.add_argument("--work-dir", help="where the scratch cache dir is made (default: the system's temp dir)")
    sp.add_argument("--cache-dir", help="build and benchmark into this cache dir and keep it: a tune stopped part way "
                                        "resumes from it (nothing compiled or measured again)")

    sp = verb("record", cmd_record, "run a command and log every Triton compile request it makes")
    sp.add_argument("-o", "--output", required=True)
    sp.add_argument("command", nargs=argparse.REMAINDER)

    sp = verb("pack", cmd_pack, "pack a cache dir into a content-addressed bundle")
    sp.add_argument("cache_dir", help="a cache dir of any layout (the one it states in .prewarm/layout: Triton's "
                                      "where none)")
    sp.add_argument("-o", "--output", required=True)
    sp.add_argument("--sign", metavar="PRIVATE_KEY", help="sign the index with this Ed25519 key (prewarm keygen)")
    sp.add_argument("--sequence", type=_number(int, 0, 1 << 62), metavar="N",
                    help="the build's sequence in the index (install refuses an older one of the same bundle name "
                         "than the one installed; default: the build's time, seconds since the epoch)")

    sp = verb("push", cmd_push, "copy a bundle to one or more stores (any fsspec URL)")
    sp.add_argument("bundle")
    sp.add_argument("urls", nargs="*", help="fsspec or oci:// URLs of the bundle's location (default: the default store)")
    sp.add_argument("--retries", type=_number(int, 0, 100), default=3, help="retries per operation on transient errors")
    sp.add_argument("--verify-remote", action=argparse.BooleanOptionalAction, default=None,
                    help="check the objects a store already has (size, sha256) and resend bad ones (default: file://)")
    sp.add_argument("--insecure", action="store_true", help="plain HTTP to a loopback OCI registry (tests)")

    sp = verb("install", cmd_install, "install a bundle into a node's cache dir, atomically")
    sp.add_argument("source", help="a bundle URL, a local bundle dir, or a bundle name in the default store")
    sp.add_argument("--cache-dir", help="default: the dir the server of the bundle's layout reads: Triton's "
                                        "TRITON_CACHE_DIR, else ~/.triton/cache; sglang-jit's SGLANG_JIT_CACHE_DIR, "
                                        "else ~/.cache/sglang/jit; flashinfer-aot: none, required")
    sp.set_defaults(usage_error=sp.error)
    sp.add_argument("--trust", action="append", default=[], metavar="PUBLIC_KEY", help="trusted signer (repeat)")
    sp.add_argument("--require-signature", action="store_true", help="refuse an unsigned bundle")
    sp.add_argument("--allow-fingerprint-mismatch", action="store_true", help="install despite toolchain mismatch")
    sp.add_argument("--allow-missing-factors", action="store_true",
                    help="install a bundle whose fingerprint lacks a blocking factor or carries one this node lacks")
    sp.add_argument("--workers", type=_number(int, 1, 1024),
                    help="parallel workers (default: a local bundle's, one process per core; a store's, 2 to 8 threads)")
    sp.add_argument("--lock-timeout", type=_number(float, 0, 86400), default=600,
                    help="seconds to wait for another install")
    sp.add_argument("--recheck", action="store_true",
                    help="check every installed entry by content, not by its stamp: repairs a file rewritten in place")
    sp.add_argument("--allow-downgrade", action="store_true",
                    help="install an older build (a lower sequence) of a bundle name than the one last installed here")
    sp.add_argument("--insecure", action="store_true", help="plain HTTP to a loopback OCI registry (tests)")

    sp = verb("verify", cmd_verify, "check a cache dir: integrity, compatibility, will-hit")
    sp.add_argument("--cache-dir", help="a cache dir of any layout (default: TRITON_CACHE_DIR, else ~/.triton/cache)")
    sp.add_argument("--plan", metavar="MANIFEST")
    sp.add_argument("--require-autotune", action="store_true",
                    help="with --plan: also fail (exit 5) when a kept autotune result is absent (device bundles)")
    sp.add_argument("--require-launchers", action="store_true",
                    help="with --plan: also fail (exit 5) when a launcher or runtime module the node would build at "
                         "first launch is absent (Ascend pre-launch jobs: the image may have no C++ compiler)")
    sp.add_argument("--bundle", help="check against this bundle (URL or dir) instead of the install receipts")
    sp.add_argument("--insecure", action="store_true", help="plain HTTP to a loopback OCI registry (tests)")
    sp.add_argument("--trust", action="append", default=[], metavar="PUBLIC_KEY",
                    help="trusted signer (repeat): a receipt counts only where its kept index is signed by one")
    sp.add_argument("--require-signature", action="store_true",
                    help="fail (exit 13) on any entry no receipt signed by a --trust key covers")
    sp.add_argument("--allow-unverified", action="store_true",
                    help="list entries no verified receipt covers (device builds, node-local compiles), never fail")
    sp.add_argument("--no-fingerprint", action="store_true", help="skip the compatibility check")
    sp.add_argument("--details", action="store_true", help="every row of every check (default: a summary)")
    sp.add_argument("--jit-dir", action="append", default=[], metavar="LAYOUT=DIR", type=_layout_dir,
                    help="a dir of modules past Triton (sglang-jit, flashinfer-aot) the server reads: checked as "
                         "the cache dir is (integrity, --trust, --require-signature, factors; everything its "
                         "library's loader could load), and with --plan the planned modules of that layout looked up "
                         "in it (default: the dir each library reads in this environment, looked up only)")
    sp.add_argument("--server", choices=tuple(server_imports()),
                    help="also check the Triton cache dir a process of this server, started with this environment, "
                         "would read (its own import run in a child process): exit 14 naming the variable to set")

    sp = verb("ls", cmd_ls, "list what a cache dir holds: installed bundles, entries no bundle installed")
    sp.add_argument("--cache-dir", help="a cache dir of any layout (default: TRITON_CACHE_DIR, else ~/.triton/cache)")

    sp = verb("explain", cmd_explain, "for each runtime compile request (a record / guard file, a key dir or a "
                                      "cache dir): planned, or the nearest planned compile and what differs")
    sp.add_argument("source", help="a `prewarm record` / guard file, a cache key dir, or a cache dir")
    sp.add_argument("--plan", required=True, metavar="MANIFEST")
    sp.add_argument("--mode", choices=("offline", "device", "auto"), default="auto",
                    help="the target driver to expand the plan under (as for build)")

    sp = verb("guard", cmd_guard, "run a command (exec) with every Triton compile the cache lacks logged, explained "
                                  "and recorded; in error mode refused (settings: PREWARM_GUARD* env vars)")
    sp.add_argument("--mode", choices=("warn", "error"), help="default: $PREWARM_GUARD, else warn")
    sp.add_argument("--record", metavar="FILE", help="append uncovered requests here (default: $PREWARM_GUARD_RECORD)")
    sp.add_argument("--plan", metavar="MANIFEST", help="explain against this plan (default: $PREWARM_GUARD_PLAN)")
    sp.add_argument("--arm", choices=("import", "manual"),
                    help="import (default): from the start; manual: from prewarm.node.guard.arm() in the server")
    sp.add_argument("--metrics-textfile", metavar="FILE.prom",
                    help="Prometheus metrics for node-exporter's textfile collector "
                         "(default: $PREWARM_METRICS_TEXTFILE)")
    sp.add_argument("command", nargs=argparse.REMAINDER)

    sp = verb("keygen", cmd_keygen, "make an Ed25519 signing key pair")
    sp.add_argument("-o", "--output", default="prewarm-signing", help="writes OUTPUT.key and OUTPUT.pub")
    sp.add_argument("--force", action="store_true", help="replace an existing key pair")

    sp = verb("fingerprint", cmd_fingerprint, "show this environment's toolchain fingerprint")
    sp.add_argument("--backend", help="build target backend (default: detected)")
    sp.add_argument("--arch", help="build target arch (default: detected)")

    sp = verb("lower", cmd_lower, "take every planned request through the compiler front end (no device)")
    sp.add_argument("manifest")

    sp = verb("manifest", cmd_manifest, "write a KDA serving manifest from the model's config.json and the server's "
                                        "launch arguments given after -- (each value commented with its source)")
    sp.add_argument("model", help="the model dir, or its config.json")
    sp.add_argument("--server", required=True, choices=tuple(servers()), help="whose launch arguments follow --")
    defaults = ", ".join(f"--server {n}" for n, s in servers().items() if s.default_kernels == n)
    sp.add_argument("--kernels", choices=kernel_choices(),
                    help=f"the KDA kernels the server runs: own (prewarm_kernels), or those of "
                         f"{', '.join(kernel_choices()[1:])} (the server's own are the default with {defaults})")
    sp.add_argument("--target", required=True, metavar="BACKEND:ARCH[:DEVICE]",
                    help="e.g. cuda:sm_90:H200 or npu:Ascend910_9391 (a device lets server defaults that depend on "
                         "its memory be taken)")
    sp.add_argument("-o", "--output", help="write the manifest here (default: print it)")
    sp.add_argument("--name", help="the manifest's name (default: the model dir's name and the server)")
    sp.__class__ = _ArgsAfterDashes  # -- SERVER_ARGS: the server's launch arguments, kept whole
    return p


NO_TRITON_VERBS = {"pack", "push", "install", "ls", "keygen"}  # the rest read or run the installed Triton


def main(argv: list[str] | None = None) -> int:
    global out, err
    out, err = _console(), _console(stderr=True)  # for the streams as they are now (a test may have replaced them)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "require_autotune", False) and not args.plan:
        parser.error("verify --require-autotune needs --plan MANIFEST (the calls whose autotune results to look for)")
    if getattr(args, "require_launchers", False) and not args.plan:
        parser.error("verify --require-launchers needs --plan MANIFEST (the kernels whose launchers to look for)")
    if getattr(args, "insecure", False):  # the OCI store's option, through fsspec's config as FSSPEC_OCI sets it
        import fsspec

        fsspec.config.conf.setdefault("oci", {})["insecure"] = True
    try:
        if args.verb not in NO_TRITON_VERBS:
            from .building.tritoncompat import require_supported

            require_supported()  # an unsupported Triton is named before any work
        return args.func(args)
    except PrewarmError as e:
        err.print(f"[bold red]error[/]: {escape(str(e))}", highlight=False)
        if getattr(args, "json", False):
            emit_json({"error": type(e).__name__, "message": str(e), "exit_code": e.exit_code})
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
