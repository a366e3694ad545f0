"""Planning: what a deployment will compile, from a manifest (``manifest``), without a device: the providers' calls
captured and expanded into Triton's compile requests (``plan``), autotune pins (``pins``), a manifest written from a
model's config and a server's launch line (``manifestgen``), and recording a server's real requests to plan from
(``record``)."""
