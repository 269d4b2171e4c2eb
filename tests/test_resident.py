"""A rank's resident memory as a rank started alone would hold it (`cost_models.resident`), read
by a real forked child of this process."""

import json
import os

from cost_models.resident import resident_by_mapping, resident_bytes


def _file_backed(pid: str) -> int:
    return sum(kb for (_, path), kb in resident_by_mapping(pid).items() if path.startswith("/")) * 1024


def test_a_process_alone_counts_its_resident_set():
    with open("/proc/self/statm") as statm:
        statm_bytes = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(resident_bytes() - statm_bytes) < 0.05 * statm_bytes


def test_a_forked_child_counts_the_library_pages_its_parent_paged_in():
    """This process has imported torch (the suite's conftest does): the pages of its libraries
    are the parent's, and fork leaves them out of the child's own count."""
    parent = os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only reads /proc, then leaves without running anything of pytest's
        try:
            own = resident_by_mapping("self")
            figures = {"alone": resident_bytes(), "forked": resident_bytes(parent),
                       "anonymous": sum(kb for (_, path), kb in own.items() if not path.startswith("/")) * 1024,
                       "parent_files": _file_backed(str(parent)), "own_files": _file_backed("self")}
            os.write(write, json.dumps(figures).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        figures = json.loads(answer.read())
    os.waitpid(pid, 0)
    # every file mapping of the parent's is the child's too: each counts at least the parent's pages
    assert figures["forked"] >= figures["anonymous"] + figures["parent_files"]
    assert figures["own_files"] < figures["parent_files"]  # what fork leaves out: the reason for all this
    assert figures["forked"] > figures["alone"]


def test_a_zygote_gone_leaves_the_process_s_own_figure():
    gone = 2**22 + 12345  # above Linux's largest pid: no such process
    assert abs(resident_bytes(gone) - resident_bytes()) < 0.05 * resident_bytes()
