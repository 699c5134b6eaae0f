"""Racing a solve against copies of itself, with other random seeds, on the other cores.

HiGHS's branch and bound runs on one thread here, and on a hard instance its time
depends on its random seed: ResNet-50 (184) at 6 GB took 72, 56, 50 and 55 s with
seeds 0 to 3. With a second core, a copy of the search with another seed runs beside
it; whichever proves its answer first ends the race. Stopped by a time limit, both
answers come back and the caller keeps the best schedule and the best bound.

Seed 0 runs in this process (its progress is the one shown); the others in forked
processes, which share the problem without copying it. A search that cannot be
interrupted (CBC through cylp) runs every seed in a forked process, and this one waits
for the first to prove its answer, or until the race's deadline: CBC counts its limit
in CPU seconds, which fall behind the clock when other work shares the cores, so at the
deadline each racer still running gets a SIGINT, which CBC takes as the end of its
search (its schedule and bound are kept). Racers ignore SIGINT otherwise: a Ctrl-C
reaches this process too, which stops them.

A search that can run past its own limit in code that polls nothing (HiGHS 1.16 in a
restart's presolve: over 14 minutes on a 118 s limit) races the same way, watched:
it tells this process what it finds as it goes (`tell`), takes a SIGINT as its stop,
and is killed once the grace after the deadline is over, what it told kept.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

RACE_GRACE_S = 5.0  # how long a search stopped by its time limit waits for the others'


def available_cores() -> int:
    """Cores this process may run on, or fewer where `OMP_NUM_THREADS` asks for fewer
    threads: processes that share the cores (pytest's workers) set it to their share,
    and a second search racing on a core another process needs only slows both (two
    MobileNetV2 tests side by side: 163 s each with their searches raced, 103 s
    without, and only then were all their solves proved)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) >= 1:
        cores = min(cores, int(threads))
    return cores


@contextlib.contextmanager
def signals_held() -> Iterator[Callable[[], bool] | None]:
    """SIGINT and SIGTERM held, then handed to their handlers on leaving; yields a test
    of whether one came (None where none is held). Only Python handlers are held (a
    racer's SIG_IGN and SIG_DFL stay), from the main thread. A signal handled in code
    that swallows exceptions is lost: HiGHS swallows one raised in our callbacks
    (progress, the race's stop), so its run ended in "Solve error", the start was
    written and the user's Ctrl-C lost; and a fork's own handlers (logging's lock
    release) ignore one, so a Ctrl-C that came while a racer forked was lost and
    solve.py exited 0. A signal mask would not do: torch's threads take a signal the
    main thread blocks."""
    held: list[tuple[int, object]] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):
                previous[signum] = handler
                signal.signal(signum, lambda s, frame: held.append((s, frame)))
    try:
        yield (lambda: bool(held)) if previous else None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum, frame in held:
            previous[signum](signum, frame)  # KeyboardInterrupt, or the CLI's Terminated


@contextlib.contextmanager
def cores_shared(workers: int) -> Iterator[None]:
    """BLAS (numpy's and scipy's OpenBLAS) limited to one racer's share of the cores.
    Each library starts a thread per core, and threads of racers side by side that
    wait on one another spin: two racers substituting CBC's sums out (a sparse LU
    solve) took 33 to 44 s where one alone took 1.7 s. Without threadpoolctl (a
    requirement, but a racer must not die for a speed-up) BLAS is left as it is."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(max(1, available_cores() // workers), user_api="blas"):
        yield


def _start(ctx, run: Callable[..., Any], seed: int, racers: list[_Racer], workers: int,
           heard=None) -> None:  # fmt: skip
    """A racer started and listed, so that a signal delivered once the fork is over
    finds it in `racers` to be stopped."""
    with signals_held():  # a signal that comes while it forks is raised after
        racers.append(_Racer(ctx, run, seed, workers, heard))


_SAID, _ANSWER = "said", "answer"  # what comes through a racer's pipe


class _Racer:
    def __init__(self, ctx, run, seed: int, workers: int, heard=None) -> None:
        self.seed, self.heard = seed, heard
        self.outcome = None
        self.done = False
        self.pipe, send = ctx.Pipe(duplex=False)
        talks = heard is not None
        args = (run, seed, send, talks, workers)
        self.process = ctx.Process(target=_race, args=args, daemon=True)
        self.process.start()
        send.close()  # ours: the pipe then reads EOF if the racer dies without an answer

    def finished(self, wait_s: float = 0.0) -> bool:
        """Whether the racer has sent its answer (read into `outcome`), waiting up to
        `wait_s` for it; what it told on the way is handed to `heard`."""
        until = time.perf_counter() + wait_s
        while not self.done and self.pipe.poll(max(0.0, until - time.perf_counter())):
            try:
                kind, payload = self.pipe.recv()
            except (EOFError, OSError):  # it died (killed, out of memory): no answer
                self.done = True
                break
            if kind == _SAID:
                self.heard(self.seed, payload)
            else:
                self.done, self.outcome = True, payload
        return self.outcome is not None

    def interrupt(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGINT)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(RACE_GRACE_S)
        if self.process.is_alive():  # SIGTERM came before its handler was reset: kill it
            self.process.kill()
            self.process.join()
        self.pipe.close()


def _race(run: Callable[..., Any], seed: int, send, talks: bool, workers: int) -> None:
    # The parent stops a racer with SIGTERM; a Python handler inherited from it would
    # wait for the solver's C code to return: die at once instead.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if talks:  # a SIGINT is its stop (the deadline's, or the user's Ctrl-C)
            interrupted: list[int] = []
            signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
            how = (lambda: bool(interrupted), lambda m: send.send((_SAID, m)))
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # only a solve in progress stops
            how = (None,)
        with cores_shared(workers):
            answer = run(seed, *how)
        send.send((_ANSWER, answer))
    finally:
        send.close()


def race(
    run: Callable[..., Any],
    workers: int,
    proved: Callable[[Any], bool],
    interruptible: bool = True,
    deadline: float | None = None,
    heard: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """`run(seed, stop)` solves with that seed, polling `stop()` (None: never stopped)
    and returns its outcome; `proved(outcome)` says whether it finished its search
    (then the other racers are not waited for). Returns the outcomes received, this
    process's first. Not `interruptible`: every seed runs in a forked process; the
    outcomes come back in seed order (a racer that died has none), and at `deadline`
    (a `time.perf_counter()` value) those still running are sent SIGINT.

    With `heard`, every seed is watched: it runs in a forked process, even alone, as
    `run(seed, stop, tell)`; each `tell(message)` reaches `heard(seed, message)` here
    as it comes; `stop()` says whether a SIGINT came (at `deadline`); one that has not
    answered `RACE_GRACE_S` after the deadline is killed and has no outcome."""
    # a racer is a daemon process, and those may not fork: one watched there runs in it
    forks = "fork" in mp.get_all_start_methods() and not mp.current_process().daemon
    if heard is not None and not forks:
        return [run(0, None, lambda message: heard(0, message))]
    if heard is None and (workers <= 1 or not forks):
        return [run(0, None)]
    ctx = mp.get_context("fork")
    if not interruptible or heard is not None:
        return _race_forked(ctx, run, workers, proved, deadline, heard)
    racers: list[_Racer] = []

    def a_racer_proved() -> bool:
        return any(r.finished() and proved(r.outcome) for r in racers)

    try:
        for seed in range(1, workers):
            _start(ctx, run, seed, racers, workers)
        # Only a racer that proved its answer stops ours: one that failed early, or ran
        # out of time a moment sooner, must not cut our search short.
        with cores_shared(workers):
            own = run(0, a_racer_proved)
        if not proved(own) and not a_racer_proved():
            # stopped by its time limit: the others, started with it, stop at theirs
            for r in racers:
                r.finished(RACE_GRACE_S)
        return [own] + [r.outcome for r in racers if r.finished()]
    finally:
        for r in racers:
            r.stop()


def _race_forked(ctx, run, workers: int, proved, deadline: float | None, heard=None) -> list:
    """Every seed in a forked process; this one waits until one has proved its answer
    or all have stopped: at `deadline` those still running are interrupted (again each
    quiet second: a racer outside CBC ignores it), and those that have not answered
    `RACE_GRACE_S` later are left out."""
    racers: list[_Racer] = []
    interrupted = False
    try:
        for seed in range(workers):
            _start(ctx, run, seed, racers, workers, heard)
        while True:
            waiting = [r for r in racers if not r.done]
            if not waiting:
                break
            timeout = None
            if deadline is not None:
                now = time.perf_counter()
                if now >= deadline + RACE_GRACE_S:
                    break
                if now >= deadline and not interrupted:
                    for r in waiting:
                        r.interrupt()
                    interrupted = True
                timeout = min(1.0, deadline + RACE_GRACE_S - now) if interrupted else deadline - now
            if not wait([r.pipe for r in waiting], timeout):
                if interrupted:
                    for r in waiting:
                        r.interrupt()
                continue
            if any(r.finished() and proved(r.outcome) for r in waiting):
                break
        return [r.outcome for r in racers if r.finished()]
    finally:
        for r in racers:
            r.stop()
