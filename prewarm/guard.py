"""The guard as a server's own code reaches it: ``prewarm.guard.arm()`` after the server's warmup
(``PREWARM_GUARD_ARM=manual``), ``armed()``, and the exceptions error mode raises (``UncoveredCompile`` and its
subclasses). The guard itself is :mod:`prewarm.node.guard`; this name is the one deployments already call."""
from .node.guard import UncoveredBenchmark, UncoveredCompile, UncoveredJitBuild, arm, armed

__all__ = ["UncoveredBenchmark", "UncoveredCompile", "UncoveredJitBuild", "arm", "armed"]
