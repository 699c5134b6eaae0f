"""Racing searches with different seeds (monet_like/solver/race.py): the first finished
wins and stops the others, a racer that dies costs nothing. HiGHS raced on a real
problem: tests/test_solver.py."""

import importlib
import os
import signal
import time

from monet_like.solver.race import RACE_GRACE_S, available_cores, race


def test_the_first_finished_search_wins_and_stops_the_others():
    def run(seed, stop):
        if seed == 0:  # this process's search: slow, until a racer has finished
            deadline = time.perf_counter() + 30
            while time.perf_counter() < deadline:
                if stop is not None and stop():
                    return ("interrupted", seed)
                time.sleep(0.01)
            return ("ran out", seed)
        return ("proved", seed, os.getpid())

    started = time.perf_counter()
    outcomes = race(run, 2, lambda o: o[0] == "proved")
    assert time.perf_counter() - started < 20  # interrupted, not run out
    assert outcomes[0] == ("interrupted", 0)
    assert outcomes[1][:2] == ("proved", 1) and outcomes[1][2] != os.getpid()


def test_a_search_that_proves_first_does_not_wait_for_the_others():
    def run(seed, stop):
        if seed == 0:
            return ("proved", 0)
        time.sleep(60)  # stopped by the race, never awaited
        return ("late", seed)

    started = time.perf_counter()
    assert race(run, 2, lambda o: o[0] == "proved") == [("proved", 0)]
    assert time.perf_counter() - started < 30


def test_a_racer_that_dies_leaves_this_process_searching():
    def run(seed, stop):
        if seed == 1:
            os._exit(3)  # killed, say: no answer comes back
        time.sleep(0.5)
        assert stop is not None and not stop()  # a dead racer is no winner
        return ("stopped by its time limit", seed)

    assert race(run, 2, lambda o: False) == [("stopped by its time limit", 0)]


def test_a_racer_that_stops_unproved_does_not_stop_this_search():
    def run(seed, stop):
        if seed == 1:
            return ("gave up", seed)  # at once, with nothing proved
        time.sleep(1.0)
        assert stop is not None and not stop()
        return ("proved", seed)

    assert race(run, 2, lambda o: o[0] == "proved") == [("proved", 0), ("gave up", 1)]


def test_one_worker_runs_here_alone():
    assert race(lambda seed, stop: (seed, stop), 1, lambda o: True) == [(0, None)]


def test_a_search_that_cannot_be_interrupted_runs_every_seed_in_a_racer():
    def run(seed, stop):
        assert stop is None  # nothing to poll: the racer is terminated instead
        if seed == 0:
            time.sleep(60)  # stopped by the race, never awaited
            return ("late", seed)
        if seed == 1:
            os._exit(3)  # dies: no answer
        return ("proved", seed, os.getpid())

    started = time.perf_counter()
    outcomes = race(run, 3, lambda o: o[0] == "proved", interruptible=False)
    assert time.perf_counter() - started < 30
    assert [o[:2] for o in outcomes] == [("proved", 2)] and outcomes[0][2] != os.getpid()


def test_racers_that_all_stop_unproved_all_answer_in_seed_order():
    def run(seed, stop):
        time.sleep(0.2 * (2 - seed))
        return ("stopped by its time limit", seed)

    outcomes = race(run, 2, lambda o: False, interruptible=False)
    assert outcomes == [("stopped by its time limit", 0), ("stopped by its time limit", 1)]


def test_searches_race_only_on_the_cores_the_environment_grants(monkeypatch):
    """pytest's workers (and a user who sets OMP_NUM_THREADS) share the cores: a second
    search on a core another process uses only slows both."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert available_cores() == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert available_cores() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 8))
    assert available_cores() == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert available_cores() == cores


def test_at_the_deadline_racers_are_interrupted_and_their_answers_kept():
    """CBC counts its limit in CPU seconds; at the race's deadline each racer still
    running gets a SIGINT, which CBC's own handler takes as the end of its search."""

    def run(seed, stop):
        got = []
        signal.signal(signal.SIGINT, lambda *_: got.append(1))  # as CBC's handler does
        waited = time.perf_counter()
        while not got and time.perf_counter() - waited < 60:
            time.sleep(0.02)
        return ("interrupted" if got else "ran out", seed)

    started = time.perf_counter()
    outcomes = race(run, 2, lambda o: False, interruptible=False, deadline=started + 1.0)
    assert outcomes == [("interrupted", 0), ("interrupted", 1)]
    assert time.perf_counter() - started < 1.0 + RACE_GRACE_S


def test_a_racer_outside_a_solve_ignores_the_interrupt_and_a_silent_one_is_left_out():
    def run(seed, stop):
        if seed == 0:  # Python between two solves: SIGINT must not kill it
            time.sleep(2.5)
            return ("answered in the grace", seed)
        time.sleep(60)  # never answers: left out once the grace is over
        return ("late", seed)

    started = time.perf_counter()
    outcomes = race(run, 2, lambda o: False, interruptible=False, deadline=started + 1.0)
    waited = time.perf_counter() - started
    assert outcomes == [("answered in the grace", 0)]
    assert 1.0 + RACE_GRACE_S - 0.5 < waited < 1.0 + RACE_GRACE_S + 10


def test_racers_share_the_cores_blas_threads_too(monkeypatch):
    """Each racer's BLAS runs on its share of the cores, this process's search too, and
    this process's own setting comes back after the race: threads of two racers' BLAS
    that wait on one another spin (CBC's rows: 1.7 s alone, 33 to 44 s side by side)."""
    import numpy  # noqa: F401  (its OpenBLAS loaded, to be limited)
    from threadpoolctl import threadpool_info, threadpool_limits

    race_module = importlib.import_module("monet_like.solver.race")  # not the function

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    def run(seed, stop):
        return blas_threads()

    monkeypatch.setattr(race_module, "available_cores", lambda: 2)
    with threadpool_limits(3, user_api="blas"):
        assert set(blas_threads()) == {3}
        for interruptible in (True, False):
            outcomes = race(run, 2, lambda o: False, interruptible)
            assert len(outcomes) == 2 and all(set(o) == {1} for o in outcomes), outcomes
        assert set(blas_threads()) == {3}
