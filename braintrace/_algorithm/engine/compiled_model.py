"""The model a learner compiled: its states by kind, the checks that it is still that model, and its reset in place.

A learner compiles its model's step once (:class:`~braintrace.ETraceGraph`) and from then on reads
and writes the very state objects it found there. This module holds what the learner does with
that compiled model outside the learning rule:

* :func:`split_states` — the states by kind, ``(params, hidden, other)``;
* :func:`check_learnable`, :func:`check_step_keeps_hidden_shapes` and
  :func:`check_registered_rules_reachable` — the refusals at compile time (a descended scan the
  rule cannot learn through, a step that reshapes a hidden state, user rules it cannot reach);
* :func:`check_states_are_compiled` and :func:`check_hidden_shapes` — the refusals at a call
  (state objects replaced in the model, hidden states of another shape);
* :func:`reset_in_place` — a new sequence: the model's states initialised again, written into the
  compiled state objects, all-or-nothing.
"""

from __future__ import annotations

import brainstate
import brainunit as u
import jax

from braintrace._algorithm.engine.config import ETraceConfig
from braintrace._compiler import ETraceGraph, ModuleInfo
from braintrace._errors import NotSupportedError
from braintrace._op._registries import has_library_rules
from braintrace._op._rule_helpers import shape_of
from braintrace._typing import Path, PyTree

__all__ = [
    "SplitStates", "split_states", "check_learnable", "check_step_keeps_hidden_shapes", "check_registered_rules_reachable",
    "check_states_are_compiled", "check_hidden_shapes", "reset_in_place",
]

#: The model's states by path: ``(params, hidden, other)``.
SplitStates = tuple[dict[Path, brainstate.ParamState], dict[Path, brainstate.HiddenState], dict[Path, brainstate.State]]


def split_states(minfo: ModuleInfo) -> SplitStates:
    """The states the compiled step touches, by kind: parameters, hidden states, the others.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> [list(states) for states in split_states(learner.graph.module_info)]
    [[('W', 'weight')], [('h',)], []]
    """
    params: dict[Path, brainstate.ParamState] = {}
    hidden: dict[Path, brainstate.HiddenState] = {}
    other: dict[Path, brainstate.State] = {}
    for path, st in minfo.retrieved_model_states.items():
        if isinstance(st, brainstate.ParamState):
            params[path] = st
        elif isinstance(st, brainstate.HiddenState):
            hidden[path] = st
        else:
            other[path] = st
    return params, hidden, other


def check_learnable(learner: str, graph: ETraceGraph, supports_scan_descent: bool, config: ETraceConfig | None) -> None:
    """Refuse a compiled step the rule of ``learner`` (its class name) cannot learn through.

    Raises
    ------
    NotImplementedError
        For a descended scan, where the rule does not support one (``supports_scan_descent``) or
        ``config`` traces the recurrent mixing of hidden states.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> check_learnable('D_RTRL', learner.graph, supports_scan_descent=False, config=None)  # no scan: nothing to refuse
    """
    descended = any(r.control_flow_context is not None for r in graph.hidden_param_op_relations) or any(
        g.descent is not None for g in graph.hidden_groups
    )
    if descended and not supports_scan_descent:
        raise NotImplementedError(
            f"{learner} cannot learn through a descended scan; use D_RTRL, or set "
            f"ControlFlowPolicy(scan_descent='off', scan_unroll_limit=N) with N at least the "
            f"loop's length, so that the loop is unrolled."
        )
    if descended and config is not None and config.include_recurrent_mixing:
        raise NotImplementedError(
            f"{learner} (recurrence_scope={config.recurrence_scope!r}) cannot trace "
            f"the recurrent mixing of hidden states inside a descended scan. Use "
            f"recurrence_scope='diagonal' (D_RTRL), or set ControlFlowPolicy(scan_descent='off', "
            f"scan_unroll_limit=N) with N at least the loop's length, so that the loop is unrolled."
        )


def check_registered_rules_reachable(graph: ETraceGraph) -> None:
    """Refuse user-registered rules where the learner cannot differentiate by them: inside a descended scan.

    Raises
    ------
    NotSupportedError
        For a primitive with user-registered rules inside a descended scan.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> check_registered_rules_reachable(learner.graph)  # library rules, no scan
    """
    for rel in graph.hidden_param_op_relations:
        if rel.control_flow_context is not None and not has_library_rules(rel.primitive):
            raise NotSupportedError(
                f"{rel.primitive.name} (parameter {rel.path}) has user-registered rules and sits "
                f"inside a descended scan, where the learner cannot differentiate it by its "
                f"registered xy_to_dw. Unroll the loop with ControlFlowPolicy(scan_descent='off', "
                f"scan_unroll_limit=N), N at least its length."
            )


def check_step_keeps_hidden_shapes(minfo: ModuleInfo) -> None:
    """A step must write every hidden state back at its own shape.

    An example input with a leading axis the states lack (a batch compiled without
    ``batch_size``, states created in ``__init__``, or a whole sequence) would make the
    step grow them; the next call would then fail.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> check_step_keeps_hidden_shapes(learner.graph.module_info)  # h stays (4,)
    """
    for path, invar in minfo.hidden_path_to_invar.items():
        before, after = shape_of(invar), shape_of(minfo.hidden_path_to_outvar[path])
        if before != after:
            raise ValueError(
                f"The model step writes the hidden state {path} with shape {after}, but the state "
                f"has shape {before}: the example input has axes the state lacks. If they are a "
                f"batch, pass batch_size=B to braintrace.compile and create the state in "
                f"init_state(batch_size) with the batch on axis 0 (a state created in __init__ is "
                f"not resized); if the leading axis is time, pass one step (xs[0])."
            )


def check_states_are_compiled(model: brainstate.nn.Module, minfo: ModuleInfo) -> None:
    """Refuse a model whose states are no longer the state objects the learner was compiled with.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> _ = brainstate.nn.init_all_states(learner.model4compile)  # new state objects in the model
    >>> check_states_are_compiled(learner.model4compile, learner.graph.module_info)
    Traceback (most recent call last):
    ...
    ValueError: The model's state ('h',) is not the state object this learner was compiled with: ...
    """
    for path, state in minfo.retrieved_model_states.items():
        found = _state_at(model, path)
        if isinstance(found, brainstate.State) and found is not state:
            raise ValueError(
                f"The model's state {path} is not the state object this learner was compiled "
                f"with: brainstate.nn.init_all_states(model) after compiling puts new state objects "
                f"in the model, which the learner does not read. Reset in place with learner.reset() "
                f"(or brainstate.nn.reset_all_states(model)), or compile again."
            )


def check_hidden_shapes(minfo: ModuleInfo, hidden_vals: dict[Path, PyTree]) -> None:
    """Hidden states must keep the shapes the learner was compiled for.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> check_hidden_shapes(learner.graph.module_info, {('h',): jnp.zeros((2, 4))})
    Traceback (most recent call last):
    ...
    ValueError: The hidden state ('h',) has shape (2, 4), but the learner was compiled for (4,). ...
    """
    compiled = minfo.hidden_path_to_invar
    for path, value in hidden_vals.items():
        expected = shape_of(compiled[path]) if path in compiled else None
        got = tuple(jax.numpy.shape(u.get_mantissa(value)))
        if expected is not None and got != expected:
            raise ValueError(
                f"The hidden state {path} has shape {got}, but the learner was compiled for "
                f"{expected}. Resetting states without the batch size (e.g. "
                f"brainstate.nn.reset_all_states(model) on braintrace.nn cells) makes them "
                f"unbatched: reset with learner.reset(), which keeps the compiled batch size "
                f"(or pass the batch size the learner was compiled for), or compile again."
            )


def reset_in_place(model: brainstate.nn.Module, minfo: ModuleInfo, batch_size: int | None) -> None:
    """The model's states initialised again at ``batch_size``, each value written into the state
    object the learner was compiled with, which stays in the model; parameters are not touched.

    ``reset_state`` and then ``init_state`` run on the model (``brainstate.nn.reset_all_states`` /
    ``init_all_states``). A failure, or a hidden state of another shape than compiled, leaves every
    state as it was.

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> h = learner.hidden_states[('h',)]
    >>> h.value = jnp.ones(4)
    >>> reset_in_place(learner.model4compile, learner.graph.module_info, None)
    >>> learner.model4compile.h is h, float(h.value.sum())
    (True, 0.0)
    """
    compiled = minfo.retrieved_model_states
    saved = {path: state.value for path, state in compiled.items()}
    try:
        brainstate.nn.reset_all_states(model, batch_size=batch_size)
        brainstate.nn.init_all_states(model, batch_size=batch_size)
        now = model.states()
        for path, state in compiled.items():
            fresh = now.get(path)
            if fresh is None or fresh is state:
                continue
            if not isinstance(state, brainstate.ParamState):
                state.value = fresh.value
            _put_at(model, path, state)
        check_hidden_shapes(minfo, {p: st.value for p, st in compiled.items() if isinstance(st, brainstate.HiddenState)})
    except BaseException:  # a failed reset leaves the model's states as they were
        for path, state in compiled.items():
            state.value = saved[path]
            _put_at(model, path, state)
        raise


def _state_at(root: brainstate.nn.Module, path: Path) -> object:
    """What sits at ``path`` (attribute names, list indices, dict keys) under ``root``, or ``None``."""
    node = root
    for key in path:
        try:
            node = getattr(node, key) if isinstance(key, str) and not isinstance(node, dict) else node[key]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return node


def _put_at(root: brainstate.nn.Module, path: Path, obj: brainstate.State) -> None:
    """Place ``obj`` at ``path`` (attribute names, list indices, dict keys) under ``root``."""
    node = root
    for key in path[:-1]:
        node = getattr(node, key) if isinstance(key, str) and not isinstance(node, dict) else node[key]
    last = path[-1]
    if isinstance(last, str) and not isinstance(node, dict):
        setattr(node, last, obj)
    else:
        node[last] = obj
