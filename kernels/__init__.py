"""Triton kernels for the KDA forward (installed as ``prewarm_kernels``; see README)."""
