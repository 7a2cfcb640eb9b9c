"""pytest hooks and fixtures shared by every test directory.

Helper functions and tables (``make_input``, ``same_bits``, ``FORMAT_CASES``, ...) live in
``tests/helpers.py``: import them with ``from helpers import ...``, never from this file.
"""

from __future__ import annotations

import os


def pytest_report_header(config):
    long = os.environ.get("TE_SERIAL_FUZZ_LONG", "") not in ("", "0")
    return [f"te-serial fuzzing: {'long run (TE_SERIAL_FUZZ_LONG)' if long else 'bounded CI run'}"]
