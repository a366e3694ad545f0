"""pyproject.toml holds the project; this adds what it cannot say without an experimental table: install's member
loop in C (prewarm/_fastunpack.c). Optional: without a C compiler and Python's headers prewarm installs without it,
and the Python reader does the same work (slower: ~100 us of CPU more per file)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("prewarm._fastunpack", ["prewarm/_fastunpack.c"], optional=True)])
