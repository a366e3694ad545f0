"""Providers for kernel libraries that were not written for prewarm (named in a manifest's ``[[kernels]] provider``)."""
