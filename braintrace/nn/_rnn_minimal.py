"""Minimal recurrent cells learned online: ``MinimalRNNCell``, ``MiniGRU`` and ``MiniLSTM``.

Each keeps one hidden state ``h`` and mixes it with an input projection through sigmoid
gates; the input projection enters ``h`` directly, so it is trained by the eligibility trace
as well as the gates.
"""

from __future__ import annotations


import brainstate
import braintools

from braintrace._typing import Initializer, Value, ValueFn
from braintrace.nn._linear import Linear
from braintrace.nn._rnn_base import CellBase, concat

__all__ = ["MinimalRNNCell", "MiniGRU", "MiniLSTM"]

sigmoid = brainstate.nn.sigmoid


class MinimalRNNCell(CellBase):
    r"""Minimal RNN cell (Chen, 2017).

    .. math::

        z = \phi(x),\quad f = σ(W_u [z, h]),\quad h \leftarrow f \odot h + (1 - f) \odot z

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    phi : callable, optional
        The input map ``n_in -> n``; by default a :class:`braintrace.nn.Linear` without
        activation (as upstream, although its docstring describes a tanh layer).
    name : str, optional

    Attributes
    ----------
    phi : callable
    W_u : braintrace.nn.Linear
        ``2n -> n``.
    h : HiddenState

    Raises
    ------
    TypeError
        If ``phi`` is given and not callable.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.MinimalRNNCell(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        phi: ValueFn | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        if phi is None:
            phi = Linear(self.num_in, self.num_out, w_init=w_init, b_init=b_init)
        elif not callable(phi):
            raise TypeError(
                f"MinimalRNNCell: phi must be callable (a layer mapping {self.num_in} -> "
                f"{self.num_out} features), got {type(phi).__name__}."
            )
        self.phi = phi
        self.W_u = Linear(2 * self.num_out, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        z = self.phi(x)
        f = sigmoid(self.W_u(concat(z, old_h)))
        self.h.value = f * old_h + (1 - f) * z
        return self.h.value


class MiniGRU(CellBase):
    r"""minGRU (Feng et al., 2024): ``z = σ(W_z [x, h])``, ``h ← (1 - z) ⊙ h + z ⊙ W_x x``.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    name : str, optional

    Attributes
    ----------
    W_x : braintrace.nn.Linear
        ``n_in -> n``.
    W_z : braintrace.nn.Linear
        ``(n_in + n) -> n``.
    h : HiddenState

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.MiniGRU(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        self.W_x = Linear(self.num_in, self.num_out, w_init=w_init, b_init=b_init)
        self.W_z = Linear(self.num_in + self.num_out, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        z = sigmoid(self.W_z(concat(x, old_h)))
        self.h.value = (1 - z) * old_h + z * self.W_x(x)
        return self.h.value


class MiniLSTM(CellBase):
    r"""minLSTM (Feng et al., 2024) without gate normalisation.

    ``f = σ(W_f [x, h])``, ``i = σ(W_i [x, h])``, ``h ← f ⊙ h + i ⊙ W_x x``.

    Parameters
    ----------
    in_size, out_size : int or tuple of int
    w_init, b_init : initializer or array
        Weight (default ``Orthogonal()``) and bias (``ZeroInit()``) initialisers.
    state_init : initializer or array
        Initial hidden state (default ``ZeroInit()``).
    name : str, optional

    Attributes
    ----------
    W_x : braintrace.nn.Linear
        ``n_in -> n``.
    W_f, W_i : braintrace.nn.Linear
        ``(n_in + n) -> n``.
    h : HiddenState

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> cell = braintrace.nn.MiniLSTM(3, 4)
    >>> cell.init_state()
    >>> cell(jnp.ones(3)).shape
    (4,)
    """

    __module__ = "braintrace.nn"

    def __init__(
        self,
        in_size: int | tuple[int, ...],
        out_size: int | tuple[int, ...],
        w_init: Initializer = braintools.init.Orthogonal(),
        b_init: Initializer | None = braintools.init.ZeroInit(),
        state_init: Initializer = braintools.init.ZeroInit(),
        name: str | None = None,
    ) -> None:
        super().__init__(in_size, out_size, state_init, name)
        n_xh = self.num_in + self.num_out
        self.W_x = Linear(self.num_in, self.num_out, w_init=w_init, b_init=b_init)
        self.W_f = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)
        self.W_i = Linear(n_xh, self.num_out, w_init=w_init, b_init=b_init)

    def update(self, x: Value) -> Value:
        self._check_input(x)
        old_h = self.h.value
        xh = concat(x, old_h)
        f = sigmoid(self.W_f(xh))
        i = sigmoid(self.W_i(xh))
        self.h.value = f * old_h + i * self.W_x(x)
        return self.h.value
