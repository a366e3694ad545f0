"""The node: what a serving node checks and watches: an installed cache against its bundle (``verify``), the plan
against the cache (``willhit``), why a compile would miss (``explain``), the toolchain's fingerprint
(``fingerprint``), where a server process reads (``serverenv``), and the guard inside the server process (``guard``,
``metrics``)."""
