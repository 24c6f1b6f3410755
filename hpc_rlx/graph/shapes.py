"""Static tensor types for graph validation: a shape (ints, ``None`` for the batch) and a dtype.

``None`` is the batch size, unknown until a batch is fed. It is a single symbol: two ``None``
dims are equal, and a ``None`` dim never equals a concrete size other than through
broadcasting against 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

FLOAT = "float"  # the executor's compute dtype (float32 or float64)
INT = "int64"
DTYPES = (FLOAT, INT)

Shape = tuple  # of int | None


class ShapeError(ValueError):
    """A type rule failed; the validator prefixes the message with the node that broke it."""


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{fmt_shape(self.shape)} {self.dtype}"


def fmt_shape(shape) -> str:
    dims = ["B" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def broadcast(a: Shape, b: Shape, what: str = "operands") -> Shape:
    """NumPy broadcasting of two static shapes."""
    out = []
    n = max(len(a), len(b))
    pa = (1,) * (n - len(a)) + tuple(a)
    pb = (1,) * (n - len(b)) + tuple(b)
    for x, y in zip(pa, pb):
        if x == y:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif y == 1:
            out.append(x)
        else:
            raise ShapeError(f"{what} shapes {fmt_shape(a)} and {fmt_shape(b)} do not broadcast")
    return tuple(out)


def require_float(t: TensorType, what: str) -> None:
    if t.dtype != FLOAT:
        raise ShapeError(f"{what} must be float, got {t.dtype}")


def require_int(t: TensorType, what: str) -> None:
    if t.dtype != INT:
        raise ShapeError(f"{what} must be int64, got {t.dtype}")


def require_ndim(t: TensorType, ndim: int, what: str) -> None:
    if t.ndim != ndim:
        raise ShapeError(f"{what} must have {ndim} dims, got shape {fmt_shape(t.shape)}")


def known_prod(shape: Shape) -> int:
    """Product of the concrete dims (the batch dim excluded)."""
    return prod(d for d in shape if d is not None)


def axis_index(axis: int, ndim: int, what: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{what} {axis} is out of range for {ndim} dims")
    return axis % ndim


def pair(value, name: str) -> tuple:
    """An int or a 2-list of ints, as a pair (for kernel / stride / padding)."""
    if isinstance(value, bool):
        raise ShapeError(f"attribute '{name}' must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (value[0], value[1])
    raise ShapeError(f"attribute '{name}' must be an int or a pair of ints, got {value!r}")


def geometry(value, name: str):
    """A convolution or pooling geometry attribute (kernel / stride / padding / dilation): an
    int (the same on every spatial axis) or a list of 2 or 3 ints (one per axis of an image or
    a volume), as an int or a tuple. The op's type rule checks a tuple's length against its
    input's spatial rank."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and len(value) in (2, 3) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ShapeError(f"attribute '{name}' must be an int or a list of 2 or 3 ints, got {value!r}")


def per_axis(value, nd: int, name: str) -> tuple:
    """A ``geometry`` attribute as one int per spatial axis of an ``nd``-D input."""
    if isinstance(value, int):
        return (value,) * nd
    if len(value) != nd:
        raise ShapeError(f"attribute '{name}' has {len(value)} values for a {nd}-D input, which needs {nd}")
    return tuple(value)
