"""sglang: its own KDA kernels, planned as each sglang KDA backend calls them: ``cuda`` (``KDAAttnBackend`` through
``TritonKDAKernel``) and ``ascend`` (``AscendKDAAttnBackend``, sgl-kernel-npu's kernels); ``common`` holds what both
share (the manifest's envelope, fake devices, launch capture); ``jit`` its ``load_jit`` modules (built by sglang's own
code); ``server`` its launch line and what its import does to the cache dirs."""
