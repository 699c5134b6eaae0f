"""PuLP's bundled CBC binary: it takes a start (-mipstart) and threads; its bound and
its schedules are read from the log it writes while it runs."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable

import numpy as np

from monet_like.solver.backends import (
    _NUMBER,
    RawResult,
    _finish,
    abs_gap_ms,
    relative_gap,
    slack_ms,
    within_tolerance,
)
from monet_like.solver.backends.cbc import (
    _CBC_POSSIBLE,
    _cbc_bound_before_restart,
    _least_printed_as,
)
from monet_like.solver.formulation import MS


def _solve_pulp(f, rhs, time_limit, gap, verbose, start, progress, threads) -> RawResult:
    with warnings.catch_warnings():  # PuLP 3 warns about its own 4.0 API change
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_pulp_quiet(f, rhs, time_limit, gap, verbose, start, progress, threads)


# Cbc0004I (branch and bound), Cbc0012I (a heuristic), Cbc0016I (strong branching),
# Cbc0024I (a subtree): each a new schedule.
_CBC_SCHEDULE = re.compile(
    rf"Cbc00\d\dI Integer solution of {_NUMBER} found.*?\({_NUMBER} seconds\)"
)


class _CbcLogWatch:
    """Follows the log that PuLP's CBC writes while it runs, for progress lines
    (CBC's binary runs in a child process PuLP waits on)."""

    def __init__(self, path: str, progress: Callable[[str], None] | None) -> None:
        self.path, self.progress = path, progress
        self.first_s: float | None = None  # CBC's clock at its first schedule
        self._best, self._bound, self._done = np.inf, None, threading.Event()
        self._text: list[str] = []  # the log as read
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not os.path.exists(self.path) and not self._done.wait(0.2):
            pass
        if not os.path.exists(self.path):
            return
        with open(self.path) as log:
            pending = ""
            while True:
                finished = self._done.wait(0.5)  # then one last read of what CBC wrote
                chunk = log.read()
                self._text.append(chunk)
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines + ([pending] if finished else []):
                    self._line(line)
                if finished:
                    return

    def _line(self, line: str) -> None:
        if found := _CBC_POSSIBLE.search(line):
            self._bound = float(found.group(1))
        if (found := _CBC_SCHEDULE.search(line)) is None:
            return
        objective, at = float(found.group(1)), float(found.group(2))
        if self.first_s is None:
            self.first_s = at
        self.show(objective, at)

    def show(self, objective: float, at: float | None) -> None:
        """A progress line for a schedule costing `objective` (ms), if it is a better one."""
        if objective >= self._best - 1e-9:
            return
        self._best = objective
        if self.progress is not None:
            gap = relative_gap(objective, self._bound)
            self.progress(
                ("[   end  ]" if at is None else f"[{at:6.1f} s]")
                + f" schedule with {objective * MS:.3f} s of recomputation"
                + ("" if gap is None else f"; bound {self._bound * MS:.3f} s, gap {gap:.2%}")
            )

    def close(self) -> str:
        """Stop following; the whole log."""
        self._done.set()
        self._thread.join()
        return "".join(self._text)


def _pulp_bound(log: str, proved: bool, objective_ms: float, slack: float) -> float | None:
    """The bound (ms) that CBC's log proves: its summary's lower bound, only the one
    shown before a restart where it restarted (see _cbc_run); for a finished search
    without a restart, its schedule less the tolerance it pruned with (`slack`, ms)."""
    if "Cbc0044I" in log:
        return _cbc_bound_before_restart(log)
    if proved:
        return objective_ms - slack
    found = re.findall(rf"Lower bound:\s+{_NUMBER}", log)
    return _least_printed_as(found[-1]) if found else _cbc_bound_before_restart(log)


def children_running(executable: str) -> list[int]:
    """PIDs of this process's live children (zombies left out) that run `executable`,
    read from Linux's /proc; none elsewhere."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                if os.path.realpath(f"/proc/{entry}/exe") == executable:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _stop_children_running(executable: str) -> None:
    """Terminate this process's children that run `executable`: a signal sent to
    solve.py alone, not to its process group, reached PuLP's wait for its CBC binary,
    and CBC ran on to its time limit."""
    for pid in children_running(executable):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:  # gone meanwhile
            continue


def _solve_pulp_quiet(f, rhs, time_limit, gap, verbose, start, progress, threads) -> RawResult:
    """The formulation written row by row into PuLP and solved by its bundled CBC
    binary: unlike CBC through cylp, it takes a start (-mipstart) and runs its search on
    `threads` threads; its bound and its schedules are read from CBC's log."""
    import pulp

    prob = pulp.LpProblem("monet_like", pulp.LpMinimize)
    xb = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(f.n_bool)]
    yc = [pulp.LpVariable(f"y{j}") for j in range(f.n_cont)]
    prob += pulp.lpSum(float(c) * xb[j] for j, c in enumerate(f.cost) if c)
    a_b, a_c = f.a_bool.tocsr(), f.a_cont.tocsr()

    def terms(a, variables, r):
        lo, hi = a.indptr[r], a.indptr[r + 1]
        return [(variables[j], v) for j, v in zip(a.indices[lo:hi], a.data[lo:hi], strict=True)]

    for r in range(f.n_rows):
        lhs = terms(a_b, xb, r) + terms(a_c, yc, r)
        expr = pulp.LpAffineExpression(lhs)
        prob += (expr == rhs[r]) if f.is_eq[r] else (expr <= rhs[r])
    if start is not None:  # CBC's -mipstart: it completes the continuous columns itself
        for v, value in zip(xb, start, strict=True):
            v.setInitialValue(int(value))
    with tempfile.TemporaryDirectory(prefix="monet_like_cbc_") as folder:
        log_path = os.path.join(folder, "cbc.log")
        cmd = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit, gapRel=gap, gapAbs=abs_gap_ms(f, gap),
            warmStart=start is not None, threads=threads if threads > 1 else None,
            logPath=log_path,
        )  # fmt: skip
        watch = _CbcLogWatch(log_path, progress)
        try:
            prob.solve(cmd)
        except BaseException:  # Ctrl-C, SIGTERM: PuLP waits on CBC and leaves it running
            _stop_children_running(os.path.realpath(cmd.path))
            raise
        finally:
            log = watch.close()
    if verbose:
        print(log, end="", flush=True)
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        return RawResult("infeasible", None, None, None, None, 0.0, "PULP")
    # Stopped without a schedule, CBC still writes a point (the relaxation's): not one.
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        message = f"no schedule found (CBC status {status}, solution status {prob.sol_status})"
        if time_limit:
            message += f" within the time limit of {time_limit:g} s: give it more time or use HIGHS"
        return RawResult("error", None, None, None, None, 0.0, "PULP", message)
    # PuLP reads back every column it wrote (0 where CBC's file omits it), and writes none
    # that is in no row and costs nothing: any value fits such a column, 0 is taken.
    x_val = np.array([round(v.varValue or 0) for v in xb], dtype=int)
    objective_ms = float(f.cost @ x_val)
    finished = prob.sol_status == pulp.LpSolutionOptimal and "Cbc0044I" not in log
    bound = _pulp_bound(log, finished, objective_ms, slack_ms(f, objective_ms, gap))
    gap_value = relative_gap(objective_ms, bound)
    proved = finished or within_tolerance(f, objective_ms, bound, gap)
    res = _finish(f, x_val, "optimal" if proved else "feasible", bound, gap_value, gap, "PULP",
                  False)  # fmt: skip
    res.first_feasible_s = watch.first_s
    # A schedule CBC found without a line this watch knows (or wrapped over two) is
    # still shown: the one returned.
    watch.show(objective_ms, None)
    return res
