"""The suite's compiles predict from the roofline: they check plans, not this machine's speed,
and measuring each model's ops first (the default compile's way) would cost seconds apiece.
tests/test_measure_defaults.py turns measuring back on for the tests of that path.

The suite keeps its own cache of calibrations and message figures, empty at the start: a
roofline plan still uses the message figures a `profile-comm` left in the cache, so with the
user's own cache a test's cuts would depend on what that user (or an earlier test run) had
measured. A fresh directory per session also keeps the suite from writing into the user's home.
"""

import os
import shutil
import tempfile

from autopart.profiling.measure_defaults import NO_MEASURE_ENV

os.environ[NO_MEASURE_ENV] = "1"
_CACHE = tempfile.mkdtemp(prefix="autopart-test-cache-")
os.environ["AUTOPART_CACHE_DIR"] = _CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)
