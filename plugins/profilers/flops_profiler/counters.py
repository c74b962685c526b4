"""FLOPs / MACs of one call of a torch function, from its arguments and its result.

Every counter has the signature ``counter(result, *args, **kwargs) -> (flops, macs)``: ``result``
is what the function returned and the rest are the call's own arguments, so parameter names follow
torch's. Conventions (DeepSpeed's): one MAC is two FLOPs; a Linear counts no FLOPs for its bias;
activations, softmax, pooling and elementwise add/mul count one FLOP per element; normalisations
count 4 FLOPs per element (5 with an affine weight); embedding lookups count nothing.

Not counted: recurrent layers (``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` run fused kernels, the printed
profile says so), the fused fast path of ``nn.MultiheadAttention`` in inference, and Python
operators other than ``@`` (``x + y`` and ``x * y`` are not counted, as in DeepSpeed; ``torch.add`` /
``Tensor.add`` / ``torch.mul`` / ``Tensor.mul`` are).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

Count = Tuple[int, int]


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(int(d) for d in shape))


# ----------------------------------------------------------------------------- dense algebra
def linear(result, input, weight, bias=None) -> Count:
    """``input (..., in) @ weight.T (in, out)``: one MAC per input element per output feature."""
    macs = input.numel() * int(weight.shape[0])
    return 2 * macs, macs


def matmul(result, input, other, *args, **kwargs) -> Count:
    """Batched / broadcast matmul: each output element is a length-``k`` dot product."""
    k = int(input.shape[-1])
    macs = result.numel() * k
    return 2 * macs, macs


def addmm(result, input, mat1, mat2, *args, **kwargs) -> Count:
    """``beta * input + alpha * mat1 @ mat2`` (also baddbmm): the product plus one add per output."""
    macs = result.numel() * int(mat1.shape[-1])
    return 2 * macs + result.numel(), macs


def conv(result, input, weight, bias=None, *args, **kwargs) -> Count:
    """conv1d/2d/3d: each output element is a dot product over ``in_channels/groups x kernel``."""
    per_output = _numel(weight.shape[1:])
    macs = result.numel() * per_output
    bias_flops = result.numel() if bias is not None else 0
    return 2 * macs + bias_flops, macs


def conv_transpose(result, input, weight, bias=None, *args, **kwargs) -> Count:
    """conv_transpose1d/2d/3d: each input element is scattered through ``out_channels/groups x kernel``.

    ``weight`` is ``(in_channels, out_channels / groups, *kernel)``.
    """
    macs = input.numel() * _numel(weight.shape[1:])
    bias_flops = result.numel() if bias is not None else 0
    return 2 * macs + bias_flops, macs


def scaled_dot_product_attention(result, query, key, value, *args, **kwargs) -> Count:
    """``softmax(Q K^T) V``: the two products (``L x S x E`` and ``L x S x Ev`` per batch-head)."""
    rows = _numel(query.shape[:-1])  # batch x heads x L
    s = int(key.shape[-2])
    macs = rows * s * int(query.shape[-1]) + rows * s * int(value.shape[-1])
    return 2 * macs, macs


# ----------------------------------------------------------------------------- elementwise
def per_output_element(result, *args, **kwargs) -> Count:
    """Activations, softmax, add, mul, interpolation: one FLOP per element produced."""
    tensor = result[0] if isinstance(result, (tuple, list)) else result
    return int(tensor.numel()), 0


def per_input_element(result, input, *args, **kwargs) -> Count:
    """Pooling: one FLOP per element read."""
    return int(input.numel()), 0


def nothing(result, *args, **kwargs) -> Count:
    """Lookups (embedding) do no arithmetic."""
    return 0, 0


def _norm(input, weight) -> Count:
    return int(input.numel()) * (5 if weight is not None else 4), 0


def layer_norm(result, input, normalized_shape, weight=None, bias=None, eps=1e-5) -> Count:
    return _norm(input, weight)


def group_norm(result, input, num_groups, weight=None, bias=None, eps=1e-5) -> Count:
    return _norm(input, weight)


def instance_norm(result, input, running_mean=None, running_var=None, weight=None, bias=None, *args, **kwargs) -> Count:
    return _norm(input, weight)


def batch_norm(result, input, running_mean, running_var, weight=None, bias=None, training=False, *args, **kwargs) -> Count:
    """Training computes batch statistics (like layer_norm); inference only scales and shifts."""
    if training:
        return _norm(input, weight)
    return int(input.numel()) * (2 if weight is not None else 1), 0


# ----------------------------------------------------------------------------- einsum
def einsum(result, equation, *operands) -> Count:
    """Contraction cost, pairing operands left to right (the order ``torch.einsum`` is given).

    Each pairwise contraction costs one MAC per point of the joint index space of the two
    operands; a single-operand einsum only sums (one FLOP per input element when it reduces).
    """
    if not isinstance(equation, str):
        raise TypeError("the sublist form of einsum is not counted")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    shapes = [tuple(int(d) for d in op.shape) for op in operands]
    terms, out_labels, sizes = _einsum_labels(equation, shapes)
    if len(terms) == 1:
        reduces = bool(set(terms[0]) - set(out_labels))
        return (_numel(shapes[0]) if reduces else 0), 0
    macs = 0
    current = terms[0]
    for i in range(1, len(terms)):
        joint = list(dict.fromkeys(current + terms[i]))
        macs += _numel(sizes[label] for label in joint)
        still_needed = set(out_labels).union(*terms[i + 1:])
        current = [label for label in joint if label in still_needed]
    return 2 * macs, macs


def _expand(term: str, ndim: Optional[int]) -> List[str]:
    """Labels of one einsum term; the dims an ellipsis stands for get labels ``'.0'``, ``'.1'``...
    counted from the right so that broadcasting lines them up across terms."""
    if "..." not in term:
        return list(term)
    head, tail = term.split("...")
    n_ellipsis = (ndim - len(head) - len(tail)) if ndim is not None else 0
    return list(head) + [f".{k}" for k in reversed(range(n_ellipsis))] + list(tail)


def _einsum_labels(equation: str, shapes) -> Tuple[List[List[str]], List[str], Dict[str, int]]:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    raw_terms = lhs.split(",")
    if len(raw_terms) != len(shapes):
        raise ValueError(f"einsum {equation!r} names {len(raw_terms)} operands but got {len(shapes)}")
    terms = [_expand(t, len(s)) for t, s in zip(raw_terms, shapes)]
    sizes: Dict[str, int] = {}
    for labels, shape in zip(terms, shapes):
        for label, dim in zip(labels, shape):
            sizes[label] = max(sizes.get(label, 1), dim)
    n_ellipsis = max((sum(1 for label in t if label.startswith(".")) for t in terms), default=0)
    ellipsis = [f".{k}" for k in reversed(range(n_ellipsis))]
    if arrow:
        head, sep, tail = rhs.partition("...")
        out_labels = list(head) + (ellipsis if sep else []) + list(tail)
    else:
        letters = [label for t in terms for label in t if not label.startswith(".")]
        out_labels = ellipsis + sorted(label for label in set(letters) if letters.count(label) == 1)
    return terms, out_labels, sizes
