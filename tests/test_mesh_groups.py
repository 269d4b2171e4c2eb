"""The mesh's process groups: each axis's members, and train.py's --timeout on every one of them
(torch's ``init_device_mesh`` gave them torch's default, 30 minutes on gloo)."""

import pytest

from tests.distributed import REPO, run_program


@pytest.mark.multiprocess
def test_mesh_groups_have_their_axes_ranks_and_the_given_timeout():
    result = run_program([str(REPO / "tests" / "mesh_groups_rank.py")], 4, timeout=120)
    assert result.stdout.count("ok") == 4
