"""The suite's compiles predict from the roofline: they check plans, not this machine's speed,
and measuring each model's ops first (the default compile's way) would cost seconds apiece.
tests/test_measure_defaults.py turns measuring back on for the tests of that path."""

import os

from autopart.profiling.measure_defaults import NO_MEASURE_ENV

os.environ[NO_MEASURE_ENV] = "1"
