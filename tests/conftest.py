"""Shared pytest set-up.

The repository root is put first on sys.path so tests import the working
tree's dsrun even when the package is not installed.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
