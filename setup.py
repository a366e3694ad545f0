"""pyproject.toml holds the project; this adds what it cannot say without an experimental table:
- the packages, found rather than listed, so a new subpackage ships without touching packaging: every package
  under prewarm/ (a dir of Python files without an ``__init__.py`` too), and kernels/ installed as
  ``prewarm_kernels`` (pyproject's ``package-dir`` maps the name; its ``packages.find`` cannot rename a dir);
- install's member loop in C (prewarm/_fastunpack.c). Optional: without a C compiler and Python's headers prewarm
  installs without it, and the Python reader does the same work (slower: ~100 us of CPU more per file)."""
from setuptools import Extension, find_namespace_packages, setup

kernels = ["prewarm_kernels", *(f"prewarm_kernels.{p}" for p in find_namespace_packages("kernels"))]
setup(packages=find_namespace_packages(include=["prewarm", "prewarm.*"]) + kernels,
      ext_modules=[Extension("prewarm._fastunpack", ["prewarm/_fastunpack.c"], optional=True)])
