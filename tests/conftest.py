import os
import warnings

import pytest
import torch


def _cores_per_worker() -> int | None:
    """Under pytest-xdist, each worker's share of the cores (None: one process)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


# Two workers each running a thread per core spin against each other: test_wrapper.py
# took 275 s so and 193 s with a thread per worker (5.8 CPU minutes against 8.3). In
# the environment too, so that the solve.py and schedule.py subprocesses profile and
# replay with the threads of the test that reads their output. The solver reads it too:
# on one core a worker races no second search (monet_like/solver/race.py).
_THREADS = _cores_per_worker()
if _THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Profiles are cached on disk: keep the tests' cache out of the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MONET_LIKE_CACHE", str(tmp_path_factory.mktemp("cache")))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torchvision's GoogLeNet init
    yield
    mp.undo()
