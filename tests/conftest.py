"""The suite's compiles predict from the roofline: they check plans, not this machine's speed,
and measuring each model's ops first (the default compile's way) would cost seconds apiece.
tests/test_measure_defaults.py turns measuring back on for the tests of that path.

The suite keeps its own cache of calibrations and message figures, empty at the start: a
roofline plan still uses the message figures a `profile-comm` left in the cache, so with the
user's own cache a test's cuts would depend on what that user (or an earlier test run) had
measured. A fresh directory per session also keeps the suite from writing into the user's home.

Where a test does measure (a profile, the default compile's measuring, a plan run once), each
measuring loop spans at most a fraction of a second (`autopart.profiling.span`): the tests check
what is measured and where it goes, not how steady the figures are, and the full spans (5 s per
graph in place, 2 s beside copies, 8 s of a plan's steps) add a minute to the suite.

Its searches cut their layouts in its own process (``AUTOPART_SEARCH_WORKERS=0``): a plan is
the same on any number of workers, which tests/test_scoring_pool.py checks with workers of its
own, and forking the suite's large process for each search of a few hundred layouts saves nothing.
"""

import os
import shutil
import tempfile

from autopart.profiling.measure_defaults import NO_MEASURE_ENV
from autopart.profiling.span import MEASURE_SECONDS_ENV
from autopart.solve.scoring_pool import WORKERS_ENV

os.environ[NO_MEASURE_ENV] = "1"
os.environ[MEASURE_SECONDS_ENV] = "0.3"
os.environ[WORKERS_ENV] = "0"
_CACHE = tempfile.mkdtemp(prefix="autopart-test-cache-")
os.environ["AUTOPART_CACHE_DIR"] = _CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)

