"""sglang's own KDA kernels, planned as each sglang KDA backend calls them: ``cuda`` (``KDAAttnBackend`` through
``TritonKDAKernel``) and ``ascend`` (``AscendKDAAttnBackend``, sgl-kernel-npu's kernels); ``common`` holds what both
share (the manifest's envelope, fake devices, launch capture), ``traffic`` the independent CUDA traffic."""
