#!/usr/bin/env python3
"""tools/strata_tools/compat/side_by_side.py as a command."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata_tools.compat.side_by_side import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
