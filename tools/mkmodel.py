#!/usr/bin/env python3
"""tools/strata_tools/mkmodel.py as a command."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strata_tools.mkmodel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
