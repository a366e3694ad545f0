"""Shipping: a cache dir packed into a content-addressed bundle (``pack``, ``bundle``: the format, ``signing``), pushed
to and fetched from a store (``stores``), installed into the dir a node's server reads (``install``, ``cachedir``:
the dir's own bookkeeping, ``layouts``: Triton's and each JIT library's dir, ``nodestamp``), listed (``scan``)."""
