"""Recurrent cells: the fused LSTM and GRU cells torch's RNN modules call per time step, and their backwards.

On a PrivateUse1 device ``nn.LSTM``/``nn.GRU`` run torch's C++ composite ``lstm``/``gru`` (layers,
directions, packed sequences, a loop over time steps); each step computes the gate matmuls and calls
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` (as on CUDA), whose autograd formula is
``_thnn_fused_lstm_cell_backward_impl`` / ``_thnn_fused_gru_cell_backward`` (with ``create_graph``
the differentiable composite instead). ``nn.RNN`` (tanh/relu) composes lowered ops and needs nothing.
The formulas follow ``aten/src/ATen/native/cuda/RNN.cu``, including its workspace layout (the saved
activations the backward reads); low precision computes in float32 and rounds once, as CUDA does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpudist.ops.lowerings._util import sigmoid, upcast
from tpudist.ops.registry import lowers

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias, count):
    """The gate pre-activations (input side, hidden side) in float32, split into ``count`` chunks each."""
    ig, hg = upcast(input_gates), upcast(hidden_gates)
    if input_bias is not None:
        ig = ig + upcast(input_bias)
    if hidden_bias is not None:
        hg = hg + upcast(hidden_bias)
    return jnp.split(ig, count, axis=-1), jnp.split(hg, count, axis=-1)


def _bias_grad(grad, has_bias):
    return grad.sum(axis=tuple(range(grad.ndim - 1))) if has_bias else None


@lowers(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    (i1, f1, g1, o1), (i2, f2, g2, o2) = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 4)
    ig, fg, cg, og = sigmoid(i1 + i2), sigmoid(f1 + f2), jnp.tanh(g1 + g2), sigmoid(o1 + o2)
    cy = fg * upcast(cx) + ig * cg
    hy = og * jnp.tanh(cy)
    workspace = jnp.concatenate([ig, fg, cg, og], axis=-1)  # the activated gates, CUDA's layout
    return hy, cy, workspace


@lowers(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    ig, fg, cg, og = jnp.split(upcast(workspace), 4, axis=-1)
    cx, cy = upcast(cx), upcast(cy)
    grad_hy = jnp.zeros_like(cy) if grad_hy is None else upcast(grad_hy)
    grad_cy = jnp.zeros_like(cy) if grad_cy is None else upcast(grad_cy)
    tanh_cy = jnp.tanh(cy)
    grad_og = grad_hy * tanh_cy * (1 - og) * og
    grad_c = grad_hy * og * (1 - tanh_cy * tanh_cy) + grad_cy
    grad_ig = grad_c * cg * (1 - ig) * ig
    grad_fg = grad_c * cx * (1 - fg) * fg
    grad_cg = grad_c * ig * (1 - cg * cg)
    grad_gates = jnp.concatenate([grad_ig, grad_fg, grad_cg, grad_og], axis=-1)
    return grad_gates, grad_c * fg, _bias_grad(grad_gates, has_bias)


@lowers(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    (ir, ii, in_), (hr, hi, hn) = _gates(input_gates, hidden_gates, input_bias, hidden_bias, 3)
    hx = upcast(hx)
    rg, ig = sigmoid(ir + hr), sigmoid(ii + hi)
    ng = jnp.tanh(in_ + rg * hn)
    hy = ng + ig * (hx - ng)
    workspace = jnp.concatenate([rg, ig, ng, hx, hn], axis=-1)  # CUDA's layout (hn with its bias)
    return hy, workspace


@lowers(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias):
    rg, ig, ng, hx, hn = jnp.split(upcast(workspace), 5, axis=-1)
    grad_hy = upcast(grad_hy)
    grad_ig = grad_hy * (hx - ng) * (1 - ig) * ig
    grad_in = grad_hy * (1 - ig) * (1 - ng * ng)
    grad_rg = grad_in * hn * (1 - rg) * rg
    grad_input_gates = jnp.concatenate([grad_rg, grad_ig, grad_in], axis=-1)
    grad_hidden_gates = jnp.concatenate([grad_rg, grad_ig, grad_in * rg], axis=-1)
    return (grad_input_gates, grad_hidden_gates, grad_hy * ig,
            _bias_grad(grad_input_gates, has_bias), _bias_grad(grad_hidden_gates, has_bias))


# -- meta kernels ------------------------------------------------------------------------------------
# torch 2.13's meta kernel of _thnn_fused_lstm_cell compares the device of every argument, biases
# included, and fails with AttributeError on a cell without biases (nn.LSTM(bias=False));
# _thnn_fused_gru_cell and its backward have none. Shapes and torch's size checks, on any device.


def _check_cell(input_gates, hidden_gates, input_bias, hidden_bias, factor, prev_hidden):
    gates = tuple(input_gates.shape)
    rule = (f"fused RNN cell: input_gates {gates} and hidden_gates {tuple(hidden_gates.shape)} must have the same "
            f"2-d shape (batch, {factor} * hidden), prev_hidden (batch, hidden) = {tuple(prev_hidden.shape)}")
    ok = input_gates.ndim == 2 and tuple(hidden_gates.shape) == gates and gates[1] % factor == 0
    ok = ok and tuple(prev_hidden.shape) == (gates[0], gates[1] // factor)
    for bias in (input_bias, hidden_bias):
        ok = ok and (bias is None or tuple(bias.shape) == (gates[1],))
    torch._check(ok, lambda: f"{rule}, biases {gates[1]} or None")


def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    _check_cell(input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    _check_cell(input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    hidden = input_gates.shape[1] // 3
    return torch.empty_like(hx), input_gates.new_empty((input_gates.shape[0], 5 * hidden))


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    batch, hidden = workspace.shape[0], workspace.shape[1] // 5
    gates = grad_hy.new_empty((batch, 3 * hidden))
    if not has_bias:
        return gates, torch.empty_like(gates), torch.empty_like(grad_hy), None, None
    bias = grad_hy.new_empty((3 * hidden,))
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, torch.empty_like(bias)


_META_LIB = torch.library.Library("aten", "IMPL")
_META_LIB.impl("_thnn_fused_lstm_cell", _lstm_cell_meta, "Meta")
_META_LIB.impl("_thnn_fused_gru_cell", _gru_cell_meta, "Meta")
_META_LIB.impl("_thnn_fused_gru_cell_backward", _gru_cell_backward_meta, "Meta")
