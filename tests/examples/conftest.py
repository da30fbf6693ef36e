import os
import sys

# `examples.dlrm` is imported from the repository root (it is not part of the package).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
