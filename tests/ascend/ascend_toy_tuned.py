"""An autotuned Triton kernel for the Ascend front-end tests, apart from ascend_toy_kernels: triton-ascend 3.2's
Autotuner asks the active driver for a benchmarker when it is made, so this module is imported only where a target
is active (a manifest's ``function`` is imported by the planner after ``lower`` activates its target)."""
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"M": 32, "N": 64}), triton.Config({"M": 64, "N": 128})], key=["K"])
@triton.jit
def dot_tuned_kernel(a, b, c, K: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    om, on, ok = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + om[:, None] * K + ok[None, :])
    y = tl.load(b + ok[:, None] * N + on[None, :])
    tl.store(c + om[:, None] * N + on[None, :], tl.dot(x, y))
