"""vLLM: its own KDA kernels as its Kimi-Linear layer calls them (``kda``), and its launch line (``server``)."""
