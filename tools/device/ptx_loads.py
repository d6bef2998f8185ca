#!/usr/bin/env python3
"""tools/strata_tools/device/ptx_loads.py as a command."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata_tools.device.ptx_loads import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
