"""Entry point of ``python -m torchrec_hybrid.stats`` (see cli.py)."""

import sys

from torchrec_hybrid.stats.cli import main

if __name__ == "__main__":
    sys.exit(main())
