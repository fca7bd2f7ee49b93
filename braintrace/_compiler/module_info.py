"""``extract_module_info``: one traced step of a brainstate module, with its state tables.

The model's ``update`` is traced once with brainstate's stateful tracing. The resulting jaxpr
reads ``[*inputs, *state values]`` and returns ``[*outputs, *new state values]`` for every
state the step touches; this module classifies those states (``ParamState`` weights,
``HiddenState`` hidden states, other states), inlines user ``jax.jit`` bodies, and builds the
``Var`` tables every later pass uses.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> minfo = braintrace.extract_module_info(Leaky(), jnp.ones(3))
>>> list(minfo.hidden_path_to_invar), list(minfo.weight_path_to_invars)
([('h',)], [('w',)])
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import brainstate
import brainunit as u
import jax

from braintrace._compatible_imports import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Var,
    closed_jaxpr_constvars,
    eval_jaxpr,
    is_var,
    new_jaxpr_eqn,
)
from braintrace._compiler.canonicalize import canonicalize_control_flow
from braintrace._compiler.control_flow_policy import (
    DEFAULT_CONTROL_FLOW_POLICY,
    ControlFlowPolicy,
    resolve_policy,
)
from braintrace._compiler.diagnostics import DiagnosticKind, DiagnosticLevel, emit
from braintrace._compiler.jaxpr_graph import fresh_var, inline_jit_calls, new_jaxpr
from braintrace._errors import ModelTypeError, NotSupportedError
from braintrace._typing import Path, PyTree

__all__ = ["ModuleInfo", "StepOutputs", "extract_module_info", "Path"]


class StepOutputs(NamedTuple):
    """One evaluated step: the model's output, the new state values by path, and the step's variables.

    ``temps`` holds the value of every variable the step outputs and of every hidden state's
    input variable (what the executors look up).
    """

    out: PyTree
    hidden_vals: dict[Path, jax.Array]
    other_vals: dict[Path, PyTree]
    temps: dict[Var, jax.Array]


class ModuleInfo(NamedTuple):
    """One traced model step and its state tables (all insertion ordered).

    Attributes
    ----------
    stateful_model : brainstate.transform.StatefulFunction
        The traced step.
    closed_jaxpr : ClosedJaxpr
        The step, user ``jit`` bodies inlined.
    retrieved_model_states : dict
        ``path -> state`` for every state the step touches.
    compiled_model_states : tuple
        The touched states in jaxpr order.
    state_id_to_path : dict
        ``id(state) -> path``.
    state_tree_invars, state_tree_outvars : list
        Per compiled state, its value's pytree with jaxpr variables as leaves.
    hidden_path_to_invar, hidden_path_to_outvar : dict
        Each hidden state's input (``h^{t-1}``) and output (``h^t``) variable.
    invar_to_hidden_path, outvar_to_hidden_path : dict
        The inverse maps.
    hidden_outvar_to_invar : dict
        ``h^t -> h^{t-1}`` variable, in compiled-state order.
    weight_invars : list
        Every ``ParamState`` leaf variable.
    weight_path_to_invars : dict
        ``ParamState`` path -> its leaf variables (``jax.tree.leaves`` order).
    invar_to_weight_path : dict
        Leaf variable -> ``ParamState`` path.
    num_var_out : int
        Number of flattened model outputs (the first jaxpr outvars).
    num_var_state : int
        Number of flattened state values after them.
    control_flow : ControlFlowPolicy
        The policy the step was compiled under.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> minfo = braintrace.extract_module_info(cell, jnp.ones(3))
    >>> list(minfo.hidden_path_to_invar), list(minfo.weight_path_to_invars), minfo.num_var_out
    ([('h',)], [('W', 'weight')], 1)
    """

    stateful_model: brainstate.transform.StatefulFunction
    closed_jaxpr: ClosedJaxpr
    retrieved_model_states: dict[Path, brainstate.State]
    compiled_model_states: tuple[brainstate.State, ...]
    state_id_to_path: dict[int, Path]
    state_tree_invars: list[PyTree]
    state_tree_outvars: list[PyTree]
    hidden_path_to_invar: dict[Path, Var]
    hidden_path_to_outvar: dict[Path, Var]
    invar_to_hidden_path: dict[Var, Path]
    outvar_to_hidden_path: dict[Var, Path]
    hidden_outvar_to_invar: dict[Var, Var]
    weight_invars: list[Var]
    weight_path_to_invars: dict[Path, list[Var]]
    invar_to_weight_path: dict[Var, Path]
    num_var_out: int
    num_var_state: int
    control_flow: ControlFlowPolicy = DEFAULT_CONTROL_FLOW_POLICY

    @property
    def jaxpr(self) -> Jaxpr:
        return self.closed_jaxpr.jaxpr

    def add_jaxpr_outs(self, jax_vars: Sequence[Var]) -> ModuleInfo:
        """A copy whose jaxpr also returns ``jax_vars`` (after the existing outputs)."""
        for v in jax_vars:
            if not is_var(v):
                raise TypeError(f"add_jaxpr_outs: expected jaxpr variables, got {type(v).__name__}.")
        jaxpr = self.jaxpr
        constvars = closed_jaxpr_constvars(self.closed_jaxpr)
        new = new_jaxpr(constvars, jaxpr.invars, [*jaxpr.outvars, *jax_vars], jaxpr.eqns, jaxpr.effects)
        return self._replace(closed_jaxpr=ClosedJaxpr(new, self.closed_jaxpr.consts))

    def split_state_outvars(self) -> tuple[dict[Path, PyTree], dict[Path, PyTree], dict[Path, PyTree]]:
        """The output variables of the states (a pytree per state), split into (weight, hidden, other) by path."""
        weights: dict[Path, PyTree] = {}
        hiddens: dict[Path, PyTree] = {}
        others: dict[Path, PyTree] = {}
        for st, tree in zip(self.compiled_model_states, self.state_tree_outvars):
            path = self.state_id_to_path[id(st)]
            table = weights if isinstance(st, brainstate.ParamState) else (
                hiddens if isinstance(st, brainstate.HiddenState) else others)
            table[path] = tree
        return weights, hiddens, others

    def jaxpr_call(self, *args: PyTree, old_state_vals: Sequence[PyTree] | None = None) -> StepOutputs:
        """Evaluate the step; returns ``(out, hidden_vals, other_state_vals, temps)``."""
        if old_state_vals is None:
            old_state_vals = [st.value for st in self.compiled_model_states]
        flat = jax.tree.leaves((args, list(old_state_vals)))
        outs = eval_jaxpr(self.jaxpr, self.closed_jaxpr.consts, *flat)
        return self._process(*args, jaxpr_outs=outs)

    def _process(self, *args: PyTree, jaxpr_outs: Sequence[jax.Array]) -> StepOutputs:
        """Split raw step outputs into ``(out, hidden_vals, other_state_vals, temps)``."""
        n_main = self.num_var_out + self.num_var_state
        treedef = self.stateful_model.get_out_treedef(*args)
        out, state_vals = jax.tree.unflatten(treedef, list(jaxpr_outs[:n_main]))
        # Every variable output by the step (hoisted intermediates, and weight/state variables
        # that pass through) can be looked up by the executors.
        temps: dict[Var, jax.Array] = {v: val for v, val in zip(self.jaxpr.outvars, jaxpr_outs) if is_var(v)}
        for path, invar in self.hidden_path_to_invar.items():
            temps[invar] = u.get_mantissa(self.retrieved_model_states[path].value)
        hidden_vals: dict[Path, jax.Array] = {}
        other_vals: dict[Path, PyTree] = {}
        for st, val in zip(self.compiled_model_states, state_vals):
            path = self.state_id_to_path[id(st)]
            if isinstance(st, brainstate.HiddenState):
                hidden_vals[path] = val
            elif not isinstance(st, brainstate.ParamState):
                other_vals[path] = val
        return StepOutputs(out, hidden_vals, other_vals, temps)

    def dict(self) -> dict[str, object]:
        return self._asdict()


def extract_module_info(
    model: brainstate.nn.Module,
    *model_args: PyTree,
    control_flow: ControlFlowPolicy | None = None,
    **model_kwargs: PyTree,
) -> ModuleInfo:
    """Trace one step ``model(*model_args, **model_kwargs)`` and build its state tables.

    Parameters
    ----------
    model : brainstate.nn.Module
        The model; its states must be initialised.
    *model_args, **model_kwargs
        Example inputs of one step (keyword inputs are traced but not replayed by
        :meth:`ModuleInfo.jaxpr_call`; bind static ones with ``functools.partial``).
    control_flow : ControlFlowPolicy, optional
        How control flow inside the step is treated.

    Returns
    -------
    ModuleInfo

    Raises
    ------
    TypeError
        If ``model`` is not a ``brainstate.nn.Module``.
    NotSupportedError
        If the step writes a ``ParamState``.
    ValueError
        If a state's unit changes during the step (raised by brainstate when it is written).

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> minfo = braintrace.extract_module_info(cell, jnp.ones(3))
    >>> isinstance(minfo, braintrace.ModuleInfo), list(minfo.retrieved_model_states)
    (True, [('W', 'weight'), ('h',)])
    """
    if not isinstance(model, brainstate.nn.Module):
        raise ModelTypeError(
            f"extract_module_info: model must be a brainstate.nn.Module, got {type(model).__name__}."
        )
    policy = resolve_policy(control_flow)
    retrieved: dict[Path, brainstate.State] = dict(brainstate.graph.states(model).items())
    stateful = brainstate.transform.StatefulFunction(model, return_only_write=False)
    closed = stateful.get_jaxpr(*model_args, **model_kwargs)
    compiled = tuple(stateful.get_states(*model_args, **model_kwargs))
    path_of = _reconcile_states(retrieved, compiled)
    for st in stateful.get_write_states(*model_args, **model_kwargs):
        if isinstance(st, brainstate.ParamState):
            raise NotSupportedError(
                f"The parameter state at path {path_of[id(st)]} is written inside the model step. "
                f"Online learning treats ParamState values as fixed within a step: compute the "
                f"changed weight into a local variable, or keep it in a ShortTermState."
            )
    closed = _own_hidden_outvars(inline_jit_calls(closed), compiled)
    minfo = _build_tables(stateful, closed, retrieved, compiled, path_of, model_args, model_kwargs, policy)
    canonical = canonicalize_control_flow(
        minfo.closed_jaxpr, weight_invars=minfo.weight_invars, hidden_invars=minfo.hidden_path_to_invar.values(),
        hidden_outvars=minfo.hidden_path_to_outvar.values(), policy=policy,
    )
    return minfo._replace(closed_jaxpr=canonical)


def _reconcile_states(
    retrieved: dict[Path, brainstate.State], compiled: tuple[brainstate.State, ...]
) -> dict[int, Path]:
    compiled_ids = {id(st) for st in compiled}
    for path in list(retrieved):
        if id(retrieved[path]) not in compiled_ids:
            emit(
                DiagnosticKind.STATE_MISMATCH, DiagnosticLevel.WARNING,
                f"State {path} belongs to the model but the step does not touch it; it is left "
                f"out of the compiled graph.",
                context={"direction": "retrieved_not_in_compiled", "path": path},
            )
            del retrieved[path]
    path_of = {id(st): path for path, st in retrieved.items()}
    for i, st in enumerate(compiled):
        if id(st) not in path_of:
            path = (f"_unknown_path_{i}",)
            emit(
                DiagnosticKind.STATE_MISMATCH, DiagnosticLevel.WARNING,
                f"The step touches a state that is not an attribute of the model; it is recorded "
                f"under the path {path}.",
                context={"direction": "compiled_not_in_retrieved", "path": path},
            )
            retrieved[path] = st
            path_of[id(st)] = path
    return path_of


def _own_hidden_outvars(closed: ClosedJaxpr, compiled: tuple[brainstate.State, ...]) -> ClosedJaxpr:
    """``closed`` with a new-value variable of its own for every hidden state.

    A step that sets a hidden state to another one's new value (``self.prev.value = self.h.value``),
    or two states to one value, returns one variable for both; the tables of the later passes are
    keyed by that variable, so one of the states would lose its perturbation and its group. Each
    later claim on a variable is written through a ``copy`` equation instead (``prev^t = copy(h^t)``):
    a hidden state that reads another's new value within the step, which the groups handle.
    """
    jaxpr = closed.jaxpr
    sizes = [len(jax.tree.leaves(st.value)) for st in compiled]
    outvars = list(jaxpr.outvars)
    position = len(outvars) - sum(sizes)
    claimed: set[Var] = set()
    copies: list[JaxprEqn] = []
    for st, size in zip(compiled, sizes):
        hidden = range(position, position + size) if isinstance(st, brainstate.HiddenState) else range(0)
        position += size
        for i in hidden:
            v = outvars[i]
            if not is_var(v):
                continue
            if v in claimed:
                outvars[i] = fresh_var(v)
                copies.append(new_jaxpr_eqn([v], [outvars[i]], jax.lax.copy_p, {}, set()))
            claimed.add(v)
    if not copies:
        return closed
    constvars = closed_jaxpr_constvars(closed)
    new = new_jaxpr(constvars, jaxpr.invars, outvars, [*jaxpr.eqns, *copies], jaxpr.effects)
    return ClosedJaxpr(new, closed.consts)


def _build_tables(
    stateful: brainstate.transform.StatefulFunction, closed: ClosedJaxpr, retrieved: dict[Path, brainstate.State],
    compiled: tuple[brainstate.State, ...], path_of: dict[int, Path],
    args: tuple[PyTree, ...], kwargs: dict[str, PyTree], policy: ControlFlowPolicy,
) -> ModuleInfo:
    jaxpr = closed.jaxpr
    num_in = len(jax.tree.leaves((args, kwargs)))
    state_trees = [jax.tree.structure(st.value) for st in compiled]
    sizes = [len(jax.tree.leaves(st.value)) for st in compiled]
    num_state = sum(sizes)
    num_out = len(jaxpr.outvars) - num_state
    tree_in, tree_out = [], []
    i_in, i_out = num_in, num_out
    for tree, size in zip(state_trees, sizes):
        tree_in.append(jax.tree.unflatten(tree, jaxpr.invars[i_in:i_in + size]))
        tree_out.append(jax.tree.unflatten(tree, jaxpr.outvars[i_out:i_out + size]))
        i_in += size
        i_out += size

    hid_in: dict[Path, Var] = {}
    hid_out: dict[Path, Var] = {}
    w_invars: dict[Path, list[Var]] = {}
    for st, t_in, t_out in zip(compiled, tree_in, tree_out):
        path = path_of[id(st)]
        if isinstance(st, brainstate.ParamState):
            w_invars[path] = list(jax.tree.leaves(t_in))
        elif isinstance(st, brainstate.HiddenState):
            (hid_in[path],) = jax.tree.leaves(t_in)
            (hid_out[path],) = jax.tree.leaves(t_out)
    weight_invars = list(dict.fromkeys(v for vs in w_invars.values() for v in vs))
    return ModuleInfo(
        stateful_model=stateful,
        closed_jaxpr=closed,
        retrieved_model_states=retrieved,
        compiled_model_states=compiled,
        state_id_to_path=path_of,
        state_tree_invars=tree_in,
        state_tree_outvars=tree_out,
        hidden_path_to_invar=hid_in,
        hidden_path_to_outvar=hid_out,
        invar_to_hidden_path={v: p for p, v in hid_in.items()},
        outvar_to_hidden_path={v: p for p, v in hid_out.items()},
        hidden_outvar_to_invar={hid_out[p]: hid_in[p] for p in hid_out},
        weight_invars=weight_invars,
        weight_path_to_invars=w_invars,
        invar_to_weight_path={v: p for p, vs in w_invars.items() for v in vs},
        num_var_out=num_out,
        num_var_state=num_state,
        control_flow=policy,
    )
