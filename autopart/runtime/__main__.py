"""``python -m autopart.runtime OUT [train.py's flags]``: the program that ``OUT/train.py`` runs,
started without ``OUT/train.py``. autopart's own runs of a compile (verify, a pipeline's profile, a
search's finalists) start this: the compile checks the stage files it executes, not train.py,
and a train.py edited in OUT ran whatever it had become under ``autopart verify``."""

import sys
from pathlib import Path

from autopart.runtime.allocator import prefer_expandable_segments

prefer_expandable_segments()  # before torch is imported, as train.py does
from autopart.runtime.train import leave, main  # noqa: E402

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    leave()
