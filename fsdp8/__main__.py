"""``python -m fsdp8``: the ``fsdp8`` command, where its script is not on PATH."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
