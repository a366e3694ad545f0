"""prewarm: build, ship and verify Triton caches ahead of time, so no serving rank ever compiles."""
__version__ = "0.1.0"
