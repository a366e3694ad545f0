"""Small Triton kernels for the Ascend front-end tests (imported by name, as a manifest's `function` refers to it)."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def add_kernel(x, y, o, T, n, BS: tl.constexpr):
    offs = tl.program_id(0) * BS + tl.arange(0, BS)
    m = offs < n
    tl.store(o + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)


@triton.jit
def cumsum_kernel(g, G, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = tl.arange(0, K)
    m = (o_t < T)[:, None]
    offs = (o_t * H + i_h)[:, None] * K + o_k[None, :]
    b = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(G + offs, tl.cumsum(b, axis=0), mask=m)


@triton.jit
def undefined_name_kernel(x, BS: tl.constexpr):
    offs = tl.arange(0, BS)
    tl.store(x + offs, tl.load(x + offs) * not_defined_anywhere)  # noqa: F821  (the AST stage refuses it)


@triton.jit
def dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    om, on, ok = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + om[:, None] * K + ok[None, :])
    y = tl.load(b + ok[:, None] * N + on[None, :])
    tl.store(c + om[:, None] * N + on[None, :], tl.dot(x, y))
