import atexit
import os
import shutil
import tempfile

import pytest

# Prefect reads these when it starts; results persist under a per-session temporary directory (removed at
# exit).
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="lrkv-prefect-results-")
atexit.register(shutil.rmtree, os.environ["PREFECT_LOCAL_STORAGE_PATH"], ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def prefect_api():
    """Prefect's real API (a temporary local server) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):  # the default 30 s is tight on a loaded 2-core box
        yield
