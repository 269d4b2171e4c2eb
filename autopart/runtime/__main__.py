"""``python -m autopart.runtime OUT [train.py's flags]``: the program that ``OUT/train.py`` runs,
started without ``OUT/train.py``. autopart's own runs of a compile (verify, a pipeline's profile, a
search's finalists) start this: the compile checks the stage files it executes, not train.py,
and a train.py edited in OUT ran whatever it had become under ``autopart verify``.

OUT goes first on ``sys.path``, where Python puts a script's folder: the stages import the modules
that the model file imported from beside it, which the compile copied into OUT."""

import sys
from pathlib import Path

from autopart.runtime.allocator import prefer_expandable_segments

if __name__ == "__main__":
    if len(sys.argv) < 2 or not Path(sys.argv[1]).is_dir():
        print("usage: python -m autopart.runtime OUT [train.py's flags]: OUT is the output directory of autopart "
              "compile", file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(out))
    prefer_expandable_segments()  # before torch is imported, as train.py does
    from autopart.runtime.train import leave, main

    main(out, sys.argv[2:])
    leave()
