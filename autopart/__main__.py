"""``python -m autopart``: the same command line as the ``autopart`` script."""

from autopart.tools.cli import run

run()
