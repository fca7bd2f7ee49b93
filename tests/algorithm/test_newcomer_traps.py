"""The mistakes every newcomer makes, each answered at the call with the fix named.

Table-driven: every trap asserts the error (or warning) type and the words of its message.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import brainstate
import jax.numpy as jnp
import pytest

import braintrace
from tests.algorithm.bptt import normal

B, I, H = 4, 3, 2


class Leaky(brainstate.nn.Module):
    """``h ← 0.5 h + x W``; the state is created in ``init_state`` (batched when asked)."""

    def __init__(self, plain_recurrence: bool = False) -> None:
        super().__init__()
        self.plain_recurrence = plain_recurrence
        self.w = brainstate.ParamState(normal(0, (I, H), 0.5))
        if plain_recurrence:
            self.u = brainstate.ParamState(normal(1, (H, H), 0.5))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.HiddenState(jnp.zeros((H,) if batch_size is None else (batch_size, H)))

    def update(self, x: Any) -> Any:
        drive = braintrace.matmul(x, self.w.value)
        if self.plain_recurrence:
            drive = drive + self.h.value @ self.u.value
        self.h.value = 0.5 * self.h.value + drive
        return self.h.value


class StateInInit(Leaky):
    """The hidden state created in ``__init__``: ``batch_size`` cannot resize it."""

    def __init__(self) -> None:
        super().__init__()
        self.h = brainstate.HiddenState(jnp.zeros(H))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        pass


class ShortTermLeaky(Leaky):
    """``Leaky`` with its recurrent state declared a ``ShortTermState``, not a ``HiddenState``."""

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        self.h = brainstate.ShortTermState(jnp.zeros((H,) if batch_size is None else (batch_size, H)))


X = normal(2, (B, I))

#: ``(id, call, error type, message words)``: each call makes one mistake at compile time.
COMPILE_TRAPS: list[tuple[str, Callable[[], Any], type, str]] = [
    ("batched-example-without-batch-size",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X),
     ValueError, r"writes the hidden state \('h',\) with shape \(4, 2\).*pass batch_size=B"),
    ("state-created-in-init",
     lambda: braintrace.compile(StateInInit(), braintrace.D_RTRL, X, batch_size=B),
     ValueError, r"init_state\(batch_size\).*created in __init__ is not resized"),
    ("batch-size-disagrees-with-example",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X, batch_size=8),
     ValueError, r"batch_size=8, but no example input has the batch on axis 0 \(shapes \(4, 3\)\).*If axis 0 is the batch, pass batch_size=4"),
    ("negative-batch-size",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X, batch_size=-1),
     ValueError, r"compile: batch_size must be a positive int .*got -1; pass the number of sequences"),
    ("fractional-batch-size",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X, batch_size=4.0),
     ValueError, r"compile: batch_size must be a positive int .*got 4.0"),
    ("whole-sequence-as-example",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, normal(3, (10, B, I)), batch_size=B),
     ValueError, r"whole sequence \(time, batch, ...\), pass one step, xs\[0\]. If axis 0 is the batch, pass batch_size=10"),
    ("vmap-with-an-unbatched-example",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X[0], batch_size=B, vmap=True),
     ValueError, r"vmap=True maps axis 0 of every example input over the batch"),
    ("unknown-learner-option-through-compile",
     lambda: braintrace.compile(Leaky(), braintrace.EProp, X, batch_size=B, kappa=0.5),
     TypeError, r"EProp has no option 'kappa'.*Did you mean 'kappa_filter_decay'"),
    ("unknown-learner-option-constructed-directly",
     lambda: braintrace.pp_prop(Leaky(), decay=0.9),
     TypeError, r"pp_prop has no option 'decay'; its options are \['decay_or_rank'.*Did you mean 'decay_or_rank'"),
    ("misspelt-vjp-method",
     lambda: braintrace.compile(Leaky(), braintrace.D_RTRL, X, batch_size=B, vjp="multi-step"),
     TypeError, r"D_RTRL has no option 'vjp'.*Did you mean 'vjp_method'"),
    ("required-option-left-out-through-compile",
     lambda: braintrace.compile(Leaky(), "pp_prop", X, batch_size=B),
     TypeError, r"pp_prop needs 'decay_or_rank'.*braintrace.compile\(model, pp_prop, example_input, decay_or_rank=...\)"),
    ("required-option-left-out-constructed-directly",
     lambda: braintrace.pp_prop(Leaky()),
     TypeError, r"pp_prop needs 'decay_or_rank', which has no default"),
]


@pytest.mark.parametrize("call, error, words", [t[1:] for t in COMPILE_TRAPS], ids=[t[0] for t in COMPILE_TRAPS])
def test_compile_time_traps(call: Callable[[], Any], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        call()


def test_a_recurrent_state_declared_short_term_is_named() -> None:
    with pytest.warns(UserWarning, match=r"weight \('w',\) reaches no hidden state"), \
            pytest.raises(braintrace.CompilationError,
                          match=r"no brainstate.HiddenState.*short-term state \('h',\) is not followed: declare a "
                                r"recurrent state as brainstate.HiddenState"):
        braintrace.compile(ShortTermLeaky(), braintrace.D_RTRL, X, batch_size=B)
    assert braintrace.compile(Leaky(), braintrace.D_RTRL, X, batch_size=B).hidden_states  # declared hidden: learns


def _learner() -> tuple[Any, Leaky]:
    model = Leaky()
    return braintrace.compile(model, braintrace.D_RTRL, X, batch_size=B), model


def test_a_trace_reset_at_another_batch_size_names_the_fix_at_the_next_call() -> None:
    learner, model = _learner()
    learner.reset_state(batch_size=7)
    with pytest.raises(ValueError, match=r"learner.reset\(\).*reset_state\(batch_size=4\).*new braintrace.compile"):
        learner(X)
    brainstate.nn.reset_all_states(model, batch_size=7)
    with pytest.raises(ValueError, match=r"a new batch size needs a new braintrace.compile"):
        learner(normal(4, (7, I)))
    learner.reset()  # back to the compiled batch: the learner works again
    assert learner(X).shape == (B, H)


@pytest.mark.parametrize("batch_size", [0, True, 2.5])
def test_a_reset_to_a_batch_size_that_is_not_a_positive_int_is_refused(batch_size: Any) -> None:
    learner, _ = _learner()
    with pytest.raises(ValueError, match=rf"D_RTRL.reset: batch_size must be a positive int .*got {batch_size!r}"):
        learner.reset(batch_size=batch_size)
    assert learner(X).shape == (B, H)  # nothing was reset half-way


def test_a_python_list_input_is_refused_naming_jnp_asarray() -> None:
    learner, _ = _learner()
    rows = [[1.0] * I] * B
    with pytest.raises(ValueError, match=r"compiled for step inputs with shapes.*pass an array, jnp.asarray\(x\)"):
        learner(rows)
    assert learner(jnp.asarray(rows)).shape == (B, H)


def test_init_all_states_after_compiling_is_refused_at_the_next_call() -> None:
    learner, model = _learner()
    learner(X)
    brainstate.nn.init_all_states(model, batch_size=B)  # new state objects
    with pytest.raises(ValueError, match=r"not the state object this learner was compiled with.*learner.reset\(\)"):
        learner(X)
    learner.reset()  # puts the compiled objects back, reset
    assert learner(X).shape == (B, H) and int(learner.running_index.value) == 1


def test_a_weight_driving_a_hidden_state_through_plain_matmul_is_named() -> None:
    with pytest.warns(UserWarning, match=r"weight \('u',\) drives the hidden states \[\('h',\)\].*braintrace.matmul"):
        learner = braintrace.compile(Leaky(plain_recurrence=True), braintrace.D_RTRL, X, batch_size=B)
    assert dict(learner.report.excluded_weights)[("u",)] == "weight_drives_hidden_untraced"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The weight .* drives the hidden states")  # the opt-out
        braintrace.compile(Leaky(plain_recurrence=True), braintrace.D_RTRL, X, batch_size=B)


class WithReadout(Leaky):
    """A plain readout ``h R`` reads the hidden state; it drives none."""

    def __init__(self) -> None:
        super().__init__()
        self.r = brainstate.ParamState(normal(5, (H, 1), 0.5))

    def update(self, x: Any) -> Any:
        return super().update(x) @ self.r.value


def test_a_readout_or_a_traced_weight_is_not_warned_about() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        learner = braintrace.compile(WithReadout(), braintrace.D_RTRL, X, batch_size=B)
    assert learner.report.excluded_weights == [(("r",), None)]
