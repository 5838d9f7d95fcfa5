"""Tests for headroom_client. Run from the repository root with:

    python3 -m unittest discover -s clients/python/tests -t clients/python
"""

import os
import sys

# Import the package from this checkout, whatever the working directory.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _PACKAGE_ROOT not in sys.path:
    sys.path.insert(0, _PACKAGE_ROOT)
