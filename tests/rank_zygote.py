"""The suite's rank zygote: `autopart.runtime.rank_zygote`, which starts the ranks of a test
launch (`tests.distributed.run_ranks`) as it starts a compile's, with one thing more: where a
launch asks for it (``AUTOPART_DEVICE_CHECK``), each rank installs tests/device_checker.py's
check before it runs its program (that module's docstring says why)."""

from __future__ import annotations

import os

from autopart.runtime.rank_zygote import main


def _device_check() -> None:
    if os.environ.get("AUTOPART_DEVICE_CHECK"):
        from tests.device_checker import install

        install(os.environ["AUTOPART_DEVICE_CHECK"])


if __name__ == "__main__":
    main(before=_device_check)
