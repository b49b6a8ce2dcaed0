"""Shared test setup: the float64 reference lives in tests/reference.py (importable as `reference`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
