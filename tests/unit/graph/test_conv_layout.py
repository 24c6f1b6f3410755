"""Convolution and pooling internals: the batch-last layout, ties in max pooling, and the
executor's exact pool-before-ReLU rewrite (same values and gradients as the graph as written)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout, build_model, init_params
from hpc_rlx.graph.ops import conv, pool
from hpc_rlx.graph.rewrite import pool_before_relu

R = np.random.default_rng(11)


def _step(g, feeds, dtype, rewrite, seed=3):
    layout = ParamLayout(g)
    params = np.empty(layout.size, dtype)
    init_params(g, params, 0)
    params += (0.05 * np.random.default_rng(1).standard_normal(layout.size)).astype(dtype)
    grads = np.empty(layout.size, dtype)
    ex = Executor(g, np, dtype, rewrite=rewrite)
    out = ex.forward_backward(layout.views(params), layout.views(grads), feeds, seed=seed)
    return ex, out, grads, layout.views(params)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_pool_before_relu_gives_the_same_values_and_gradients(dtype, dropout):
    g = build_model("cnn", input_shape=(2, 12, 10), num_classes=5, channels=[4, 6], kernel=3, hidden=8,
                    pool="max", dropout=dropout)
    moved = pool_before_relu(g)[1]
    assert moved == {"act0", "act1"}
    # integers: plenty of ties inside windows, and windows whose maximum is 0 or negative
    x = R.integers(-2, 3, (5, 2, 12, 10)).astype(dtype)
    feeds = {"x": x, "y": R.integers(0, 5, 5)}
    ex, out, grads, pv = _step(g, feeds, dtype, rewrite=True)
    _, ref_out, ref_grads, _ = _step(g, feeds, dtype, rewrite=False)
    assert out == ref_out
    assert np.array_equal(grads, ref_grads)
    # a fetch of a moved node is the graph as written
    plain = Executor(g, np, dtype, rewrite=False).run(pv, {"x": x}, ["act0", "pool1", "logits"])
    got = ex.run(pv, {"x": x}, ["act0", "pool1", "logits"])
    for k in plain:
        assert np.array_equal(got[k], plain[k]), k
    assert np.array_equal(ex.run(pv, {"x": x}, "pool0")["pool0"], Executor(g, np, dtype, rewrite=False)
                          .run(pv, {"x": x}, "pool0")["pool0"])


def test_pool_before_relu_leaves_a_relu_that_something_else_reads():
    b = GraphBuilder("two_readers")
    x = b.input("x", [None, 1, 6, 6])
    y = b.input("y", [None], "int64")
    w = b.param("w", [2, 1, 3, 3], {"scheme": "he_normal", "fan_in": 9})
    r = b.op("relu", b.op("conv2d", x, w, name="c", padding=1), name="r")
    p = b.op("max_pool2d", r, name="p", kernel=2)
    s = b.op("add", b.op("flatten", p, name="f1"), b.op("flatten", b.op("avg_pool2d", r, name="a", kernel=2),
                                                         name="f2"), name="s")
    hw = b.param("hw", [18, 3], {"scheme": "xavier_uniform", "fan_in": 18, "fan_out": 3})
    logits = b.op("linear", s, hw, name="logits")
    b.output("loss", b.op("softmax_cross_entropy", logits, y, name="xent"))
    g = b.build()
    assert pool_before_relu(g) == (g, frozenset())


def test_max_pool_ties_go_to_the_first_maximum_as_in_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = R.integers(0, 3, (3, 4, 8, 6)).astype(np.float64)  # many equal values per window
    for kernel, stride, padding, dilation in [(2, 2, 0, 1), (3, 2, 1, 1), (3, 1, 1, 2), (2, 1, 0, 1)]:
        out, index = pool.max_pool_forward(np, x, (kernel, kernel), (stride, stride), (padding, padding), True,
                                           (dilation, dilation))
        g = R.standard_normal(out.shape)
        gx = pool.max_pool_grad(np, g, index, x.shape, (kernel, kernel), (stride, stride), (padding, padding),
                                (dilation, dilation))
        t = torch.tensor(x, requires_grad=True)
        ref = F.max_pool2d(t, kernel, stride, padding, dilation=dilation)
        ref.backward(torch.from_numpy(g))
        assert np.array_equal(out, ref.detach().numpy())
        assert np.allclose(gx, t.grad.numpy(), rtol=0, atol=1e-12), (kernel, stride, padding, dilation)


def test_outputs_are_batch_last_and_any_input_layout_works():
    x = R.standard_normal((3, 4, 7, 6))
    w, b = R.standard_normal((5, 4, 3, 3)), R.standard_normal(5)
    y, cols = conv.conv2d_forward(np, x, w, b, (1, 1), (1, 1))
    assert y.strides[0] == y.itemsize and cols.flags.c_contiguous  # (C, H, W, B) underneath
    # a batch-first input, a batch-last one and a strided view give the same result
    xl = np.ascontiguousarray(x.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)
    xs = np.ascontiguousarray(np.repeat(x, 2, axis=3))[:, :, :, ::2]
    for other in (xl, xs):
        assert np.array_equal(conv.conv2d_forward(np, other, w, b, (1, 1), (1, 1))[0], y)
    g = R.standard_normal(y.shape)  # a batch-first cotangent
    gx = conv.conv2d_grad_x(np, g, w, x.shape, (1, 1), (1, 1))
    gl = conv.conv2d_grad_x(np, np.ascontiguousarray(g.transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2), w, x.shape,
                            (1, 1), (1, 1))
    assert np.allclose(gx, gl, rtol=1e-13, atol=1e-13)
    assert np.allclose(conv.conv2d_grad_b(np, g), g.sum(axis=(0, 2, 3)), rtol=1e-12)


@pytest.mark.parametrize("attrs", [
    {"padding": 2},                                   # wider than the kernel needs
    {"padding": [2, 0], "stride": [1, 2]},
    {"padding": 1, "dilation": 2},
    {"padding": [0, 3], "stride": 1},
    {"padding": 1, "stride": 3},                      # some inputs read by no offset
])
def test_conv_geometries_match_torch(attrs):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x, w, b = R.standard_normal((3, 4, 7, 6)), R.standard_normal((5, 4, 3, 3)), R.standard_normal(5)
    s, p, d = (conv_pair(attrs.get(k, v)) for k, v in (("stride", 1), ("padding", 0), ("dilation", 1)))
    y, cols = conv.conv2d_forward(np, x, w, b, s, p, d)
    g = R.standard_normal(y.shape)
    gx = conv.conv2d_grad_x(np, g, w, x.shape, s, p, d)
    gw = conv.conv2d_grad_w(np, g, cols, w.shape)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ref = F.conv2d(tx, tw, tb, stride=s, padding=p, dilation=d)
    ref.backward(torch.from_numpy(g))
    assert np.allclose(y, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert np.allclose(gx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert np.allclose(gw, tw.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert np.allclose(conv.conv2d_grad_b(np, g), tb.grad.numpy(), rtol=1e-12, atol=1e-12)


def conv_pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)
