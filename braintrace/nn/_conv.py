"""Convolution layers whose kernels learn online: ``Conv1d``, ``Conv2d``, ``Conv3d``.

Each subclasses the ``brainstate.nn`` layer of the same name (constructor, kernel layout,
padding normalisation, input checks and output-shape inference unchanged) and replaces its
convolution hook so that the kernel and bias reach the model through
:func:`braintrace.conv`.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._op.conv import conv
from braintrace._typing import Value
from braintrace.nn._arguments import ArgumentCheck, check_constructor_arguments, positive_int, size_tuple

__all__ = ["Conv1d", "Conv2d", "Conv3d"]

#: The convolutions' sizes, checked before brainstate's constructor runs (which would divide by
#: a zero kernel, stride or group count, or build an empty kernel).
_CONV_SIZES: dict[str, ArgumentCheck] = {
    "in_size": size_tuple,
    "out_channels": positive_int,
    "kernel_size": size_tuple,
    "stride": size_tuple,
    "lhs_dilation": size_tuple,
    "rhs_dilation": size_tuple,
    "groups": positive_int,
}

#: The names of the spatial axes of one sample, as brainstate's docstrings write them.
_SPATIAL_AXES = {1: ("L",), 2: ("H", "W"), 3: ("H", "W", "D")}


def _kernel_mask_fn(mask: Value) -> Callable[[jax.Array], jax.Array]:
    mask_m = jnp.asarray(u.get_mantissa(mask))

    def apply(kernel: jax.Array) -> jax.Array:
        return kernel * mask_m

    return apply


def _layout(names: tuple[str, ...]) -> str:
    return "(" + ", ".join(names) + ")"


class _OnlineConv:
    """The argument checks, convolution hook and input check shared by the three layers.

    A mixin placed before the parent, whose constructor the three layers share.
    """

    # attributes provided by brainstate's _Conv
    num_spatial_dims: int
    in_size: tuple[int, ...]
    in_channels: int
    channel_first: bool
    w_mask: Value | None
    stride: tuple[int, ...]
    padding: str | Sequence[tuple[int, int]]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    groups: int
    dimension_numbers: jax.lax.ConvDimensionNumbers

    def __init__(self, *args: object, **kwargs: object) -> None:
        check_constructor_arguments(type(self).__name__, super().__init__, args, kwargs, _CONV_SIZES)
        super().__init__(*args, **kwargs)

    def _check_input_dim(self, x: Value) -> None:
        """``x`` must be one sample ``in_size`` or a batch of them, ``(batch, *in_size)``.

        Raises
        ------
        ValueError
            Naming the layer, the expected and the received shapes and the fix.
        """
        shape = tuple(jnp.shape(u.get_mantissa(x)))
        n = self.num_spatial_dims
        sample = shape[1:] if len(shape) == n + 2 else shape if len(shape) == n + 1 else None
        if sample == tuple(self.in_size):
            return
        spatial = _SPATIAL_AXES[n]
        names = ("C_in", *spatial) if self.channel_first else (*spatial, "C_in")
        layer = type(self).__name__
        raise ValueError(
            f"{layer}: the expected input shape is {_layout(('batch', *names))} ({n + 2}D) or, for "
            f"one sample, {_layout(names)} ({n + 1}D), with in_size={tuple(self.in_size)} "
            f"({self.in_channels} input channels); got shape {shape} ({len(shape)}D)"
            + ("" if sample is None or len(shape) == n + 1 else f" (one sample: {sample})")
            + f". {self._input_fix(shape, sample)}"
        )

    def _input_fix(self, shape: tuple[int, ...], sample: tuple[int, ...] | None) -> str:
        in_size = tuple(self.in_size)
        dims = ", ".join(map(str, in_size))
        if sample is None:
            if len(shape) > len(in_size) + 1 and shape[-len(in_size):] == in_size:
                return f"Merge the leading axes into one batch axis: x.reshape(-1, {dims})."
            return f"Reshape the input to (batch, {dims}) or {in_size}."
        n = self.num_spatial_dims
        if self.channel_first and sample[-1:] + sample[:-1] == in_size:
            return (
                f"The input looks channels-last: move its channel axis (jnp.moveaxis(x, -1, {-n - 1})), "
                f"or build the layer with channel_first=False."
            )
        if not self.channel_first and sample[1:] + sample[:1] == in_size:
            return (
                f"The input looks channels-first: move its channel axis (jnp.moveaxis(x, {-n - 1}, -1)), "
                f"or build the layer with channel_first=True."
            )
        channels = sample[0 if self.channel_first else -1]
        if channels == self.in_channels:
            return (
                f"Its spatial size differs from the layer's: build the layer with in_size={sample}, "
                f"or crop or resize the input to {in_size}."
            )
        return (
            f"It has {channels} channels where the layer takes {self.in_channels}: build the "
            f"layer with in_size={sample}, or feed {self.in_channels}-channel inputs."
        )

    def _conv_op(self, x: Value, params: dict[str, jax.Array]) -> Value:
        # the mask runs inside the primitive so masked kernel entries get exactly zero gradient
        kernel_fn = None if self.w_mask is None else _kernel_mask_fn(self.w_mask)
        return conv(
            x,
            params["weight"],
            params.get("bias"),
            strides=self.stride,
            padding=self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            feature_group_count=self.groups,
            dimension_numbers=self.dimension_numbers,
            kernel_fn=kernel_fn,
        )


_PARAMETERS = """
    Parameters
    ----------
    in_size : tuple of int
        One sample's shape without the batch axis: ``(*spatial, C_in)``, or ``(C_in, *spatial)``
        when ``channel_first``.
    out_channels : int
    kernel_size : int or tuple of int
    stride, lhs_dilation, rhs_dilation : int or tuple of int
        Replicated to every spatial axis when given as one int.
    padding : {'SAME', 'VALID'}, int or sequence of (low, high)
    groups : int
        Feature groups; ``in`` and ``out`` channels must be divisible by it.
    w_init : initializer or array
        Kernel initialiser (default ``XavierNormal()``), kernel shape
        ``(*kernel_size, C_in // groups, C_out)``.
    b_init : initializer, array or None
        Bias initialiser (default ``None``: no bias).
    w_mask : array, initializer or None
        Kernel mask, applied inside the primitive (masked entries get zero gradient).
    channel_first : bool
    name : str, optional
    param_type : type
        State class of the parameters (default ``brainstate.ParamState``).

    Attributes
    ----------
    weight : ParamState
        ``{'weight': kernel, 'bias': ...}`` (``'bias'`` only with ``b_init``).
    out_size : tuple of int
        One output sample's shape, inferred at construction.

    Raises
    ------
    ValueError
        At construction, if ``in_size``, ``out_channels``, ``kernel_size``, ``stride``, a
        dilation or ``groups`` is not a positive int (or, where a tuple is allowed, a tuple of
        them); at the call, if the input is neither one sample of shape ``in_size`` nor a batch
        ``(batch, *in_size)``; the message names the expected and the received shapes and the
        fix (a channels-first map fed to a channels-last layer is recognised as such).

    Notes
    -----
    Unbatched input gets a batch axis added and removed around the convolution. D-RTRL
    traces are kept per output position (memory ``batch · positions · |kernel| · S``).
"""


class Conv1d(_OnlineConv, brainstate.nn.Conv1d):
    __doc__ = (
        """One-dimensional convolution whose kernel (and bias) learn online.

    The constructor is that of ``brainstate.nn.Conv1d``; the convolution runs through
    :func:`braintrace.conv`.
"""
        + _PARAMETERS
        + """
    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.Conv1d((8, 2), 3, kernel_size=3)
    >>> layer(jnp.ones((4, 8, 2))).shape
    (4, 8, 3)
    """
    )
    __module__ = "braintrace.nn"


class Conv2d(_OnlineConv, brainstate.nn.Conv2d):
    __doc__ = (
        """Two-dimensional convolution whose kernel (and bias) learn online.

    The constructor is that of ``brainstate.nn.Conv2d``; the convolution runs through
    :func:`braintrace.conv`.
"""
        + _PARAMETERS
        + """
    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.Conv2d((6, 6, 1), 4, kernel_size=3, padding='VALID')
    >>> layer(jnp.ones((6, 6, 1))).shape
    (4, 4, 4)
    """
    )
    __module__ = "braintrace.nn"


class Conv3d(_OnlineConv, brainstate.nn.Conv3d):
    __doc__ = (
        """Three-dimensional convolution whose kernel (and bias) learn online.

    The constructor is that of ``brainstate.nn.Conv3d``; the convolution runs through
    :func:`braintrace.conv`.
"""
        + _PARAMETERS
        + """
    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> layer = braintrace.nn.Conv3d((4, 4, 4, 1), 2, kernel_size=2, stride=2)
    >>> layer(jnp.ones((1, 4, 4, 4, 1))).shape
    (1, 2, 2, 2, 2)
    """
    )
    __module__ = "braintrace.nn"


# the three layers share brainstate's _Conv constructor, whose signature the check keeps
setattr(_OnlineConv.__init__, "__signature__", inspect.signature(brainstate.nn.Conv1d.__init__))
