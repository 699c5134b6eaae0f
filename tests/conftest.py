import os
import warnings

import pytest
import torch


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, the cores shared among the workers (None: a single process)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


# Workers that each start a thread per core slow one another down. Set in the
# environment too, so that the solve.py and schedule.py subprocesses profile and
# replay with the same number of threads as the test that reads their output.
_THREADS = _threads_per_worker()
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
