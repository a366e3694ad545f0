"""Per-entry work spread over the cores: install's and verify's, where a cache holds up to 100,000 entries.

Parsing tar members, creating files and walking dirs are Python: threads share one core for them. So a job over a
local cache runs in forked processes, which inherit its read-only state (the parsed index, the receipts) instead of
receiving it pickled; only small results travel back. Work that waits on a remote store runs in threads.
"""
from __future__ import annotations

import os
from typing import Any, Callable

PROCESSES_FROM = 512  # entries: below this, forking costs more than it saves

_shared: Any = None  # the state of the job this process works for


def shared() -> Any:
    return _shared


def _set(state: Any) -> None:
    global _shared
    _shared = state


def _start_worker(state: Any, parent: int) -> None:
    """A forked worker: dies with the process that forked it. Killed (SIGKILL), that process leaves its workers
    holding each other's pipes, and its install lock (an inherited descriptor), forever otherwise."""
    _die_with_parent()
    if os.getppid() != parent:  # it died before this worker asked
        os._exit(1)
    _set(state)


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def cores() -> int:
    """The cores this process may run on (a container's cpuset, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def can_fork() -> bool:
    """Whether this process may fork workers now: only while it runs no other thread (a thread could hold a lock,
    the allocator's or logging's, that the children would wait on forever). Callers size their work by it; ``run``
    asks again."""
    import threading

    return threading.active_count() == 1


def run(fn: Callable, tasks: list[tuple], state: Any, *, processes: bool, workers: int,
        done: Callable[[Any], None] | None = None, started: Callable[[bool], None] | None = None) -> list:
    """``fn(*task)`` for each task, results in task order; ``fn`` reads ``shared()``. In forked processes where
    ``processes`` and :func:`can_fork`, else in threads. ``done(result)`` as each arrives (in order);
    ``started(forked)`` once every worker exists (no thread of ours may run while a process forks; ``forked``: the
    workers are processes, so state only they read may be let go). On a failure nothing more starts, and every
    running task ends before the error is raised, so that the caller can remove what they were writing."""
    import concurrent.futures as cf

    _set(state)
    forked = processes and can_fork()
    if forked:
        import multiprocessing

        pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                      initializer=_start_worker, initargs=(state, os.getpid()))
    else:
        pool = cf.ThreadPoolExecutor(workers)
    results = []
    try:
        futures = [pool.submit(fn, *t) for t in tasks]
        if started:
            started(forked)
        for f in futures:
            results.append(f.result())
            if done:
                done(results[-1])
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        _set(None)
    pool.shutdown(wait=True)
    return results


def ranges(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, n)) for i in range(0, n, step)]
