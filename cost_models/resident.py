"""A process's resident memory, as a rank started on its own would hold it.

``autopart profile-comm`` reads a rank's resident memory once it has imported the runtime,
joined its group and run a step of a tiny model: the memory every rank takes besides its
model's tensors. Its ranks on the CPU are forked (`autopart.runtime.rank_zygote`), and a forked
process's resident set lacks the library pages its parent paged in at its imports, which a rank
started alone (under torchrun, as users start them) pages in itself.
"""

from __future__ import annotations

__all__ = ["resident_bytes", "resident_by_mapping"]


def resident_bytes(zygote: int | None = None) -> int:
    """This process's resident memory, as a rank started on its own would hold it. A rank forked
    from a ``zygote`` (`autopart.runtime.rank_zygote`) uses the library pages the zygote paged in
    at its imports without having them in its own resident set, where a rank started alone pages
    them in itself: per file-backed mapping (forked, the two have the same ones) the larger of the
    two counts (short of the truth where each touched pages of one mapping that the other did not)."""
    own = resident_by_mapping("self")
    try:
        shared = resident_by_mapping(str(zygote)) if zygote is not None else {}
    except OSError:  # the zygote's ended, or its maps are not ours to read: this process's own
        shared = {}
    return sum(max(kb, shared.get(mapping, 0) if mapping[1].startswith("/") else 0)
               for mapping, kb in own.items()) * 1024


def resident_by_mapping(pid: str) -> dict[tuple[str, str], int]:
    """(address range, file or "") -> resident kilobytes, of ``/proc/<pid>/smaps``."""
    resident, mapping = {}, ("", "")
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields[0] == "Rss:":
                resident[mapping] = int(fields[1])
            elif not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode[, path]
                mapping = (fields[0], fields[5] if len(fields) > 5 else "")
    return resident
