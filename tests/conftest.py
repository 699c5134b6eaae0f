import warnings

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Profiles are cached on disk: keep the tests' cache out of the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MONET_LIKE_CACHE", str(tmp_path_factory.mktemp("cache")))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torchvision's GoogLeNet init
    yield
    mp.undo()
