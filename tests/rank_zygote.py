"""The suite's rank zygote: `autopart.runtime.rank_zygote`, which starts the ranks of a test
launch (`tests.distributed.run_ranks`) as it starts a compile's, with what a launch asks for more:
each rank installs tests/device_checker.py's check (``AUTOPART_DEVICE_CHECK``) and
tests/host_reads.py's counter of the host's waits for the device (``AUTOPART_HOST_READS``) before
it runs its program (those modules' docstrings say why)."""

from __future__ import annotations

import os

from autopart.runtime.rank_zygote import main


def _instrument() -> None:
    if os.environ.get("AUTOPART_DEVICE_CHECK"):
        from tests.device_checker import install

        install(os.environ["AUTOPART_DEVICE_CHECK"])
    if os.environ.get("AUTOPART_HOST_READS"):
        from tests.host_reads import install as count_reads

        count_reads(os.environ["AUTOPART_HOST_READS"])


if __name__ == "__main__":
    main(before=_instrument)
