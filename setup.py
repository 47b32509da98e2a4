"""Packaging entry kept for `DSRUN_BUILD_OPS=1 pip install .` (ahead-of-time op builds).

All metadata lives in pyproject.toml.
"""
from setuptools import setup

setup()
