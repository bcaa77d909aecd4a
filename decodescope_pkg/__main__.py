"""``python -m decodescope``: the command line."""

from decodescope.ui.cli import main

main()
