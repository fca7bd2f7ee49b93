"""Graph executors: run a compiled model step and extract what eligibility traces need.

From one model step the executor reads, for every relation, the input ``x`` of its ETP
equation and ``df`` (the Jacobian of the ``y -> h`` tail applied to ``ones_like(y)``), and for
every hidden group the per-position hidden Jacobian ``D``. With :class:`MultiStepData` input it
runs the steps in one ``lax.scan``, stacking those values (or rolling a trace inside the scan).

A learner that differentiates the step's transitions itself (UORO: ``D_full · s̃`` as a JVP,
``νᵀ ∂h/∂y`` as a VJP) sets :attr:`ETraceGraphExecutor.transition_points`: every group's slot
then holds the step's :class:`TransitionPoint` instead of ``D``, every relation's ``df`` slot
its :class:`TailPoint`, and no Jacobian is extracted.

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
>>> executor = braintrace.ETraceGraphExecutor(Leaky())
>>> executor.compile_graph(jnp.ones(3))
>>> out, hidden, others, (xs, dfs), Ds, _ = executor.solve_h2w_h2h_jacobian(jnp.ones(3))
>>> Ds[0][..., 0, 0]
Array([0.5, 0.5], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence, TypedDict, TypeGuard, TypeVar, Union

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from braintrace._algorithm.engine.config import Recurrence
from braintrace._algorithm.engine.input_data import (
    get_single_step_data,
    merge_data,
    sequence_length,
    split_input_data_types,
)
from braintrace._algorithm.engine.jaxpr_eval import bind_eqn, eval_jaxpr
from braintrace._algorithm.engine.rule_vjp import bind_by_registered_rule
from braintrace._algorithm.engine.while_vjp import bind_reversibly
from braintrace._compatible_imports import Jaxpr, JaxprEqn, Literal, Var
from braintrace import _compatible_imports as jax_compat
from braintrace._compiler import (
    CompilationReport,
    ControlFlowPolicy,
    ETraceGraph,
    compile_etrace_graph,
)
from braintrace._compiler.control_flow_policy import resolve_policy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation, tail_constvars
from braintrace._compiler.hidden_group import HiddenGroup, calls_custom_vjp, state_basis
from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._compiler.position_dependence import tail_keeps_positions, tail_reach
from braintrace._compiler.snap_pattern import (
    DEFAULT_MAX_JACOBIAN_ELEMENTS,
    SnapPattern,
    pad_states,
    widened_tail_jacobian,
)
from braintrace._errors import NotSupportedError, internal_error
from braintrace._op._registries import get_y_outvar_index, has_library_rules, is_etp_primitive
from braintrace._typing import Array, Path, PyTree, TraceKey

__all__ = [
    "ETraceGraphExecutor", "ETraceVjpGraphExecutor", "StepJacobians", "StepPoints", "DfKey", "EtraceStepper",
    "WeightJacobians", "WeightPoints", "CallWeightJacobians", "CallHiddenJacobians", "CallJacobians",
    "is_step_jacobians",
    "TransitionPoint", "TailPoint", "df_key",
    "detached_df_key", "trace_key", "history_jacobian_key", "widens",
]

#: The key of a value among a step's ``dfs``: :func:`df_key`, :func:`history_jacobian_key`
#: or :func:`detached_df_key`.
DfKey = Union[tuple[int, str], tuple[int, str, str]]


class TransitionPoint(NamedTuple):
    """Where one step evaluated a hidden group's transition ``h^{t-1} -> h^t``.

    ``group.transition(hidden, inputs)`` is the step's ``h^t``; a JVP of it in ``hidden``
    applies the whole within-group Jacobian to a tangent without materialising it.

    Attributes
    ----------
    hidden : list
        ``h^{t-1}`` of every member (``group.hidden_invars`` order).
    inputs : list
        The transition's other inputs (``group.transition_jaxpr_constvars`` order).
    """

    hidden: list[Array]
    inputs: list[Array]


class TailPoint(NamedTuple):
    """Where one step evaluated a relation's ``y -> h`` tail for one group.

    ``eval_jaxpr(tail, consts, y)`` is the group's members at ``t``, with the tail's other
    inputs held at the step's values.

    Attributes
    ----------
    y : array
        The relation's output ``y``.
    consts : list
        The tail's other inputs (its jaxpr's constvars, in order).
    """

    y: Array
    consts: list[Array]


#: ``(xs, dfs)`` of one step: every relation's ``x`` (keyed by ``id(x_var)``) and ``df`` (keyed by
#: :data:`DfKey`).
WeightJacobians = tuple[dict[int, Array], dict[DfKey, Array]]
#: :data:`WeightJacobians` with each relation's :class:`TailPoint` in place of its ``df``.
WeightPoints = tuple[dict[int, Array], dict[DfKey, Union[Array, TailPoint]]]
#: ``((xs, dfs), Ds)`` of one step: :data:`WeightJacobians` and the list of per-group ``D``.
StepJacobians = tuple[WeightJacobians, list[Array]]
#: :data:`StepJacobians` of a learner that sets :attr:`ETraceGraphExecutor.transition_points`:
#: each relation's :class:`TailPoint` in place of its ``df``, each group's :class:`TransitionPoint`
#: in place of its ``D``.
StepPoints = tuple[WeightPoints, list[TransitionPoint]]
#: A call's ``(xs, dfs)`` as a learner receives it (stacked over the steps of a window).
CallWeightJacobians = Union[WeightJacobians, WeightPoints]
#: A call's ``Ds`` as a learner receives it (stacked over the steps of a window).
CallHiddenJacobians = Union[list[Array], list[TransitionPoint]]
#: A call's ``((xs, dfs), Ds)``: :data:`StepJacobians` or :data:`StepPoints` (stacked over the steps of a window).
CallJacobians = Union[StepJacobians, StepPoints]
#: A learner's trace carried through the scan of a window (its own pytree of arrays).
Carry = TypeVar("Carry")
#: ``stepper(trace, (xs, dfs, Ds)) -> (trace, None)``: rolls a learner's trace over one step of a scan.
#: The slots hold :data:`StepJacobians`' arrays, or :data:`StepPoints`' points under
#: ``transition_points`` (a flag of the executor), so their types are the learner's to name.
EtraceStepper = Callable[[Carry, tuple[Any, ...]], tuple[Carry, None]]


def is_step_jacobians(jac: CallJacobians) -> TypeGuard[StepJacobians]:
    """Whether ``jac`` holds Jacobians (:data:`StepJacobians`), not the points of an executor
    with ``transition_points`` (:data:`StepPoints`).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> is_step_jacobians((({}, {}), [jnp.ones((4, 1, 1))]))
    True
    >>> is_step_jacobians((({}, {}), [TransitionPoint([jnp.zeros(4)], [])]))
    False
    """
    return not any(isinstance(D, TransitionPoint) for D in jac[1]) and not any(
        isinstance(df, TailPoint) for df in jac[0][1].values())


def df_key(relation: HiddenParamOpRelation, group: HiddenGroup) -> tuple[int, str]:
    """The key of a relation's ``df`` for one of its groups."""
    return (id(relation.y_var), f"hidden_group_{group.index}")


def history_jacobian_key(group: HiddenGroup) -> tuple[int, str]:
    """The key, among a step's ``dfs``, of a group's partial hidden Jacobian (see
    :meth:`HiddenGroup.history_jacobian`); present only for groups whose members read each
    other's new values within the step. (Negative first entry: never an ``id``; keys of one
    dict must stay mutually comparable for pytree flattening.)"""
    return (-1 - group.index, "history_jacobian")


def trace_key(relation: HiddenParamOpRelation, group: HiddenGroup) -> TraceKey:
    """The key of a relation's D-RTRL trace for one of its groups."""
    return (id(relation.y_var), group.index)


class _CompileOptions(TypedDict, total=False):
    """The keyword arguments an executor adds to :func:`~braintrace.compile_etrace_graph`."""

    include_hidden_perturb: bool
    sparse_n: int
    snap_max_jacobian_elements: int


class ETraceGraphExecutor:
    """Owns a model and its compiled :class:`ETraceGraph`; runs steps and extracts Jacobians.

    Parameters
    ----------
    model : brainstate.nn.Module
    include_recurrent_mixing : bool
        Compile hidden groups with weight mixing traced into the transitions.
    control_flow : ControlFlowPolicy, optional

    Attributes
    ----------
    transition_points : bool
        When set (by a learner), :meth:`extract_jacobians` hands over each group's
        :class:`TransitionPoint` in place of its ``D``, each relation's :class:`TailPoint` in
        place of its ``df``, and extracts no Jacobian.
    include_weight_to_weight : bool
        When set (by a learner, before :meth:`compile_graph`), ``y -> h`` tails may cross other
        trainable ETP operations (see :func:`~braintrace.compile_etrace_graph`).
        Groups inside a descended scan have no single transition point; such learners refuse them.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> executor = braintrace.ETraceGraphExecutor(cell)
    >>> executor.compile_graph(jnp.ones(3))
    >>> [group.hidden_paths for group in executor.graph.hidden_groups]
    [[('h',)]]
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        include_recurrent_mixing: bool = False,
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        if not isinstance(model, brainstate.nn.Module):
            raise TypeError(f"The model must be a brainstate.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.include_recurrent_mixing = include_recurrent_mixing
        self.control_flow = resolve_policy(control_flow)
        self.transition_points = False
        self.include_weight_to_weight = False
        self._graph: ETraceGraph | None = None
        self._state_id_to_path: dict[int, Path] | None = None
        self._out_treedef: jax.tree_util.PyTreeDef | None = None
        self._compiled_signature: _ArgSignature | None = None
        self._compiled_dtypes: tuple[str, ...] = ()
        # Outputs of the relation equations whose primitive has user-registered rules.
        self._ruled_outputs: set[Var] = set()

    # --- compilation ----------------------------------------------------------------------

    @property
    def graph(self) -> ETraceGraph:
        if self._graph is None:
            raise ValueError('The eligibility-trace graph is not compiled yet: call ".compile_graph()" first.')
        return self._graph

    @property
    def states(self) -> dict[Path, brainstate.State]:
        return self.graph.module_info.retrieved_model_states

    path_to_states = states

    @property
    def state_id_to_path(self) -> dict[int, Path]:
        if self._state_id_to_path is None:
            self._state_id_to_path = {id(st): p for p, st in self.states.items()}
        return self._state_id_to_path

    def _compile_kwargs(self) -> _CompileOptions:
        return _CompileOptions()

    def compile_graph(self, *args: PyTree) -> None:
        """Compile the model step for example inputs (multi-step inputs contribute their first step)."""
        args = get_single_step_data(*args)
        self._graph = compile_etrace_graph(
            self.model, *args, include_recurrent_mixing=self.include_recurrent_mixing,
            include_weight_to_weight=self.include_weight_to_weight, control_flow=self.control_flow,
            **self._compile_kwargs(),
        )
        self._state_id_to_path = None
        self._ruled_outputs = {
            rel.y_var for rel in self._graph.hidden_param_op_relations
            if rel.control_flow_context is None and not has_library_rules(rel.primitive)
        }
        self._out_treedef = self._graph.module_info.stateful_model.get_out_treedef(*args)
        self._compiled_signature = _arg_signature(args)
        self._compiled_dtypes = _arg_dtypes(args)

    def _check_call_args(self, args: Sequence[PyTree]) -> None:
        """Refuse a step of ``args`` without the compiled structure and shapes (``ValueError``) or dtypes (``TypeError``).

        The compiled step is shape-specialised: another batch size, a missing argument or a
        different layout would otherwise fail deep inside the evaluation of the step.
        """
        if self._compiled_signature is None:
            return
        step = get_single_step_data(*args)
        got = _arg_signature(step)
        if got != self._compiled_signature:
            lists = (" A Python list is a pytree of separate values to JAX: pass an array, jnp.asarray(x)."
                     if any(isinstance(a, list) for a in step) else "")
            raise ValueError(
                f"The learner was compiled for step inputs with shapes {_describe(self._compiled_signature)}, "
                f"but this call's step inputs have shapes {_describe(got)}. Call it with inputs of the "
                f"compiled structure and shapes (MultiStepData adds a leading time axis); a new batch "
                f"size or input layout needs a new braintrace.compile(...).{lists}"
            )
        dtypes = _arg_dtypes(step)
        if dtypes != self._compiled_dtypes:
            raise TypeError(
                f"The learner was compiled for step inputs of dtypes {_listed(self._compiled_dtypes)}, "
                f"but this call's step inputs have dtypes {_listed(dtypes)}. The compiled step is "
                f"specialised to its dtypes: cast the inputs (x.astype(...)), or compile with an "
                f"example input of the new dtype."
            )

    def show_graph(self, verbose: bool = True, return_msg: bool = False) -> str | None:
        """The compilation report (level 1); printed when ``verbose``."""
        msg = CompilationReport(self.graph).to_str(1)
        if verbose:
            print(msg)
        return msg if return_msg else None

    # --- one step -------------------------------------------------------------------------

    def _bind(self, eqn: JaxprEqn, operands: list[Array]) -> list[Array]:
        """Bind a step equation; relations with user-registered rules are differentiated by them, and
        ``while`` loops in reverse mode by recomputing their iterations (:func:`bind_reversibly`)."""
        ruled = self._ruled_outputs and is_etp_primitive(eqn.primitive)
        if ruled and eqn.outvars[get_y_outvar_index(eqn.primitive)] in self._ruled_outputs:
            return bind_by_registered_rule(eqn, operands)
        return bind_reversibly(eqn, operands)

    def _flat_inputs(self, args: Sequence[PyTree], state_vals: dict[Path, PyTree]) -> list[Array]:
        minfo = self.graph.module_info
        values = [state_vals[minfo.state_id_to_path[id(st)]] for st in minfo.compiled_model_states]
        return list(jax.tree.leaves((tuple(args), values)))

    def run_step(
        self,
        args: Sequence[PyTree],
        state_vals: dict[Path, PyTree],
        perturb: Sequence[Array] | None = None,
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Var, Array]]:
        """One step: ``(out, new state values by path, env)``; ``env`` maps step vars to values.

        With ``perturb`` the perturbed step runs (hidden outputs shifted by ``perturb``).
        """
        graph = self.graph
        minfo = graph.module_info
        flat = self._flat_inputs(args, state_vals)
        if perturb is None:
            jaxpr, consts = minfo.jaxpr, minfo.closed_jaxpr.consts
            outs = eval_jaxpr(jaxpr, consts, flat, self._bind)
            invars = list(jaxpr.invars)
        else:
            if graph.hidden_perturb is None:
                raise internal_error("a perturbed run of a graph compiled without the hidden perturbation")
            closed = graph.hidden_perturb.perturb_jaxpr
            jaxpr, consts = closed.jaxpr, closed.consts
            outs = eval_jaxpr(jaxpr, consts, [*flat, *perturb], self._bind)
            invars = list(jaxpr.invars)[: len(flat)]
        env: dict[Var, Array] = dict(zip(invars, flat))
        env.update((v, o) for v, o in zip(jaxpr.outvars, outs) if isinstance(v, Var) and not isinstance(v, Literal))
        n_main = minfo.num_var_out + minfo.num_var_state
        out, new_states = jax.tree.unflatten(self._out_treedef, list(outs[:n_main]))
        new_vals = {
            minfo.state_id_to_path[id(st)]: val for st, val in zip(minfo.compiled_model_states, new_states)
        }
        return out, new_vals, env

    def extract_jacobians(self, env: Mapping[Var, Array]) -> CallJacobians:
        """``((xs, dfs), Ds)`` of one step from its variable values (all ``stop_gradient``-ed).

        With :attr:`transition_points`, ``Ds`` holds each group's :class:`TransitionPoint` and
        ``dfs`` each relation's :class:`TailPoint`.

        The values are read through ``stop_gradient`` before any Jacobian is taken: a learner
        extracts them inside the VJP of its step, and an undetached read would have that VJP
        trace the derivative of every Jacobian too (then discard it).
        """
        detached = _DetachedValues(env)
        return self._points(detached) if self.transition_points else self._jacobians(detached)

    def _points(self, env: Mapping[Var, Array]) -> StepPoints:
        """:meth:`extract_jacobians` with :attr:`transition_points`, on values already detached."""
        graph = self.graph
        xs: dict[int, Array] = {}
        dfs: dict[DfKey, Array | TailPoint] = {}
        for rel in graph.hidden_param_op_relations:
            if rel.control_flow_context is not None:
                descended_dfs: dict[DfKey, Array] = {}
                _extract_descended_relation(rel, env, xs, descended_dfs)
                dfs.update(descended_dfs)
                continue
            if rel.x_var is not None:
                xs[id(rel.x_var)] = env[rel.x_var]
            for tail, group in zip(rel.y_to_hidden_group_jaxprs, rel.hidden_groups):
                dfs[df_key(rel, group)] = TailPoint(env[rel.y_var], [env[v] for v in tail_constvars(tail)])
        return jax.lax.stop_gradient(((xs, dfs), _transition_points(graph.hidden_groups, env)))

    def _jacobians(self, env: Mapping[Var, Array]) -> StepJacobians:
        """:meth:`extract_jacobians` without :attr:`transition_points`, on values already detached."""
        graph = self.graph
        xs: dict[int, Array] = {}
        dfs: dict[DfKey, Array] = {}
        for rel in graph.hidden_param_op_relations:
            if rel.control_flow_context is not None:
                _extract_descended_relation(rel, env, xs, dfs)
                continue
            if rel.x_var is not None:
                xs[id(rel.x_var)] = env[rel.x_var]
            y = env[rel.y_var]
            for i, group in enumerate(rel.hidden_groups):
                tail = rel.y_to_hidden_group_jaxprs[i]
                consts = [env[v] for v in tail_constvars(tail)]

                def fn(
                    y: Array, tail: Jaxpr = tail, consts: list[Array] = consts, group: HiddenGroup = group,
                ) -> Array:
                    return group.concat_hidden(jax_compat.eval_jaxpr(tail, consts, y))

                dfs[df_key(rel, group)] = _tail_df(fn, y, rel, group, tail)
                if contains_eqn(tail, lambda e: e.primitive.name == "while"):
                    dfs[detached_df_key(rel, group)] = dfs[df_key(rel, group)] - _df_around_whiles(
                        tail, consts, y, group)
        Ds = [
            _descended_group_jacobian(group, env) if group.descent is not None else group.diagonal_jacobian(
                [env[v] for v in group.hidden_invars], [env[v] for v in group.transition_jaxpr_constvars]
            )
            for group in graph.hidden_groups
        ]
        for group in graph.hidden_groups:
            if group.descent is None and group.reads_new_members():
                dfs[history_jacobian_key(group)] = group.history_jacobian(
                    [env[v] for v in group.hidden_invars], [env[v] for v in group.transition_jaxpr_constvars])
        return jax.lax.stop_gradient(((xs, dfs), Ds))

    # --- whole calls ----------------------------------------------------------------------

    def solve_h2w_h2h_jacobian(
        self,
        *args: PyTree,
        state_vals: dict[Path, PyTree] | None = None,
        etrace_stepper: EtraceStepper[PyTree] | None = None,
        init_etrace: PyTree = None,
    ) -> tuple[PyTree, dict[Path, PyTree], dict[Path, PyTree], CallWeightJacobians | None, CallHiddenJacobians | None,
               PyTree]:
        """Run the call (one step, or a scan over :class:`MultiStepData`) and extract Jacobians.

        Returns
        -------
        (out, hidden_vals, other_vals, hid2weight_jac, hid2hid_jac, final_etrace)
            For multi-step input the Jacobians carry a leading time axis; with an
            ``etrace_stepper`` they are ``None`` and ``final_etrace`` is the rolled trace.
        """
        if state_vals is None:
            state_vals = {p: st.value for p, st in self.states.items()}
        out, new_vals, jac, final = self.run_call(args, state_vals, etrace_stepper, init_etrace)
        hidden, other = self.split_hidden_other(new_vals)
        h2w, h2h = (None, None) if jac is None else jac
        return out, hidden, other, h2w, h2h, final

    def split_hidden_other(self, vals: dict[Path, PyTree]) -> tuple[dict[Path, PyTree], dict[Path, PyTree]]:
        hidden, other = {}, {}
        for path, val in vals.items():
            st = self.states[path]
            if isinstance(st, brainstate.HiddenState):
                hidden[path] = val
            elif not isinstance(st, brainstate.ParamState):
                other[path] = val
        return hidden, other

    def run_call(
        self,
        args: Sequence[PyTree],
        state_vals: dict[Path, PyTree],
        etrace_stepper: EtraceStepper[Carry] | None = None,
        init_etrace: Carry | None = None,
    ) -> tuple[PyTree, dict[Path, PyTree], CallJacobians | None, Carry | None]:
        """``(out, new state values, jacobians or None, rolled trace or None)`` for one call."""
        self._check_call_args(args)
        single, multi, treedef = split_input_data_types(*args)
        if not multi:
            step_args = merge_data(treedef, single)
            out, new_vals, env = self.run_step(step_args, state_vals)
            return out, new_vals, self.extract_jacobians(env), None
        length = sequence_length(multi)
        params = {p: v for p, v in state_vals.items() if isinstance(self.states[p], brainstate.ParamState)}
        carried = {p: v for p, v in state_vals.items() if p not in params}

        def body(
            carry: tuple[dict[Path, PyTree], Carry | None], xs_t: PyTree,
        ) -> tuple[tuple[dict[Path, PyTree], Carry | None], tuple[PyTree, CallJacobians | None]]:
            vals, trace = carry
            step_args = merge_data(treedef, single, xs_t)
            out, new_vals, env = self.run_step(step_args, {**params, **vals})
            jac = self.extract_jacobians(env)
            new_carry = {p: new_vals[p] for p in vals}
            if etrace_stepper is None:
                return (new_carry, trace), (out, jac)
            if trace is None:
                raise internal_error("a trace stepper without the trace it rolls")
            trace, _ = etrace_stepper(trace, (*jac[0], jac[1]))
            return (new_carry, trace), (out, None)

        (final_vals, final_trace), (outs, jacs) = jax.lax.scan(body, (carried, init_etrace), multi, length=length)
        return outs, {**params, **final_vals}, jacs, final_trace


class _DetachedValues(Mapping[Var, Array]):
    """A step's variable values, each read through ``stop_gradient`` (once, when first read)."""

    def __init__(self, env: Mapping[Var, Array]) -> None:
        self._env = env
        self._read: dict[Var, Array] = {}

    def __getitem__(self, var: Var) -> Array:
        if var not in self._read:
            self._read[var] = jax.lax.stop_gradient(self._env[var])
        return self._read[var]

    def __iter__(self) -> Iterator[Var]:
        return iter(self._env)

    def __len__(self) -> int:
        return len(self._env)


def _transition_points(groups: Sequence[HiddenGroup], env: Mapping[Var, Array]) -> list[TransitionPoint]:
    """Every group's :class:`TransitionPoint` in one step."""
    points = []
    for group in groups:
        if group.descent is not None:
            raise NotImplementedError(
                f"Hidden group {group.index} ({group.hidden_paths}) lives inside a descended scan, "
                f"which has no single transition point per step."
            )
        points.append(TransitionPoint([env[v] for v in group.hidden_invars],
                                      [env[v] for v in group.transition_jaxpr_constvars]))
    return points


#: The structure and the leaf shapes of a call's step inputs.
_ArgSignature = tuple[jax.tree_util.PyTreeDef, tuple[tuple[int, ...], ...]]


def _arg_signature(args: Sequence[PyTree]) -> _ArgSignature:
    leaves, treedef = jax.tree.flatten(tuple(args))
    return treedef, tuple(tuple(jnp.shape(leaf)) for leaf in leaves)


def _arg_dtypes(args: Sequence[PyTree]) -> tuple[str, ...]:
    """The canonical dtype of every leaf (a Python number as the array JAX makes of it)."""
    return tuple(np.dtype(jnp.result_type(leaf)).name for leaf in jax.tree.leaves(tuple(args)))


def _listed(dtypes: tuple[str, ...]) -> str:
    return "(" + ", ".join(dtypes) + ("," if len(dtypes) == 1 else "") + ")"


def _describe(signature: _ArgSignature) -> str:
    treedef, shapes = signature
    return str(jax.tree.unflatten(treedef, [f"<{s}>" for s in shapes])).replace("'", "")


def detached_df_key(relation: HiddenParamOpRelation, group: HiddenGroup) -> tuple[int, str, str]:
    """The key of the part of a relation's ``df`` that crosses a ``while_loop`` (see below)."""
    return (*df_key(relation, group), "through_while")


def _bind_detaching_whiles(eqn: JaxprEqn, operands: list[Array]) -> list[Array]:
    if eqn.primitive.name == "while":
        operands = [jax.lax.stop_gradient(v) for v in operands]
    return bind_eqn(eqn, operands)


def _tail_df(fn: Callable[[Array], Array], y: Array, rel: HiddenParamOpRelation, group: HiddenGroup, tail: Jaxpr) -> Array:
    """``df``: the Jacobian of the ``y -> h`` tail ``fn`` applied to ``ones_like(y)``, ``(*varshape, S)``.

    One JVP. A tail calling a ``custom_vjp`` function (which forward mode cannot differentiate)
    is differentiated by one VJP per state instead: the same values where the tail provably keeps
    every ``y`` at its position, so it is refused where it may move values, broadcasts ``y`` or
    holds a ``while`` (which reverse mode cannot enter).

    Raises
    ------
    NotSupportedError
        For a tail calling a ``custom_vjp`` function that reverse mode cannot stand in for.
    """
    if not calls_custom_vjp(tail):
        return jax.jvp(fn, (y,), (jnp.ones_like(y),))[1]
    varshape = tuple(group.varshape)
    if tuple(jnp.shape(y)) != varshape:
        why = f"a broadcast of y {tuple(jnp.shape(y))} over the positions {varshape}"
    elif contains_eqn(tail, lambda e: e.primitive.name == "while"):
        why = "a while_loop, which reverse mode cannot enter"
    elif not tail_keeps_positions(tail, varshape):
        why = "an operation that may move values between positions"
    else:
        why = None
    if why is not None:
        raise NotSupportedError(
            f"The output of {rel.primitive.name} with weight {rel.path} reaches the hidden states "
            f"{group.hidden_paths} through a jax.custom_vjp function and through {why}; forward mode "
            f"cannot differentiate a custom_vjp function, and reverse mode does not give df there. "
            f"Define that function with jax.custom_jvp (its forward rule serves both modes)."
        )
    out, pullback = jax.vjp(fn, y)
    cotangents = state_basis(out.shape[:-1], out.shape[-1], out.dtype)
    rows = jax.vmap(lambda ct: pullback(ct)[0])(cotangents)  # rows[a, p] = ∂h[p, a] / ∂y[p]
    return jnp.moveaxis(rows, 0, -1)


def _df_around_whiles(tail: Jaxpr, consts: Sequence[Array], y: Array, group: HiddenGroup) -> Array:
    """The part of ``df`` that does not cross a ``while_loop`` of the tail.

    The perturbed step detaches the inputs of a hidden-producing ``while`` (reverse mode cannot
    enter it), so the one-step autodiff gradient misses the rest, ``df`` minus this part; the
    learners add that part themselves (keyed by :func:`detached_df_key`).
    """

    def fn(y: Array) -> Array:
        return group.concat_hidden(eval_jaxpr(tail, consts, [y], _bind_detaching_whiles))

    return jax.jvp(fn, (y,), (jnp.ones_like(y),))[1]


def _extract_descended_relation(
    rel: HiddenParamOpRelation, env: Mapping[Var, Array], xs: dict[int, Array], dfs: dict[DfKey, Array],
) -> None:
    """``x`` and ``df`` of a relation inside a descended scan, stacked over its substeps ``(L, ...)``.

    The relation's variables are body-scoped; their per-substep values are the scan's stacked
    outputs, and ``df`` is the tail's Jacobian at every substep (vmapped over the substep axis).
    """
    context = rel.control_flow_context
    if context is None:
        raise internal_error(f"the relation of {rel.primitive.name} read as descended is outside any scan")
    stacked = context.scan.stacked_var_map
    if rel.x_var is not None:
        xs[id(rel.x_var)] = env[stacked[rel.x_var]]
    y_seq = env[stacked[rel.y_var]]
    for tail, group in zip(rel.y_to_hidden_group_jaxprs, rel.hidden_groups):
        const_seq = [env[stacked[v]] for v in tail_constvars(tail)]

        def df_at(y: Array, consts: list[Array], tail: Jaxpr = tail, group: HiddenGroup = group) -> Array:
            def fn(y: Array) -> Array:
                return group.concat_hidden(jax_compat.eval_jaxpr(tail, consts, y))

            return jax.jvp(fn, (y,), (jnp.ones_like(y),))[1]

        dfs[df_key(rel, group)] = jax.vmap(df_at)(y_seq, const_seq)


def _descended_group_jacobian(group: HiddenGroup, env: Mapping[Var, Array]) -> Array:
    """``D`` of a group carried by a descended scan at every substep: ``(L, *varshape, S, S)``."""
    descent = group.descent
    if descent is None:
        raise internal_error(f"hidden group {group.index} read as descended is outside any scan")
    stacked = descent.scan.stacked_var_map
    hidden_seq = [env[stacked[v]] for v in descent.body_hidden_invars]
    input_seq = [env[stacked[v]] for v in group.transition_jaxpr_constvars]
    return jax.vmap(group.diagonal_jacobian)(hidden_seq, input_seq)


class ETraceVjpGraphExecutor(ETraceGraphExecutor):
    """An executor for learners built on a custom VJP (single-step or multi-step windows).

    Two axes of a learner's coordinate act here, on every step's per-group ``D`` before any
    trace update sees it (one step, a stacked window, a per-step stepper alike):

    * ``sparse_n`` (SnAp, see :mod:`braintrace._algorithm.param_trace.snap`): a group with a SnAp pattern
      hands over ``Dg`` (the within-group Jacobian gathered onto each position's neighbourhood,
      ``(*varshape, K·S, K·S)``) and its relations' ``df`` zero-padded to ``K·S``;
    * :attr:`recurrence` (``temporal_recursion``): ``D`` replaced by the rule's ``R``.

    Parameters
    ----------
    model : brainstate.nn.Module
    vjp_method : {'single-step', 'multi-step'}
        ``'single-step'``: every call is one step and the learning signal is ``∂L/∂h^t`` (read
        off the hidden perturbation). ``'multi-step'``: a call may cover a window of steps,
        differentiated exactly inside the window.
    include_recurrent_mixing : bool
    control_flow : ControlFlowPolicy, optional
    sparse_n : int, optional
        The SnAp order the graph is compiled with (needs ``include_recurrent_mixing``).
    snap_max_jacobian_elements : int
        Ceiling on a widened group's block Jacobian ``P·(K·S)²``.

    Attributes
    ----------
    recurrence : callable or None
        Set by a learner whose ``temporal_recursion`` is not ``'jacobian'``: ``D -> R``
        (:class:`~braintrace._algorithm.engine.config.Recurrence`), applied to every group's ``D`` and
        partial history Jacobian.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> cell = brainstate.nn.init_all_states(braintrace.nn.ValinaRNNCell(3, 4))
    >>> executor = braintrace.ETraceVjpGraphExecutor(cell, vjp_method='multi-step')
    >>> executor.compile_graph(jnp.ones(3))
    >>> executor.is_single_step_vjp
    False
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        vjp_method: str = "single-step",
        include_recurrent_mixing: bool = False,
        control_flow: ControlFlowPolicy | None = None,
        sparse_n: int | None = None,
        snap_max_jacobian_elements: int = DEFAULT_MAX_JACOBIAN_ELEMENTS,
    ) -> None:
        if vjp_method not in ("single-step", "multi-step"):
            raise ValueError(f"vjp_method must be 'single-step' or 'multi-step', got {vjp_method!r}.")
        super().__init__(model, include_recurrent_mixing=include_recurrent_mixing, control_flow=control_flow)
        self.vjp_method = vjp_method
        self.sparse_n = sparse_n
        self.snap_max_jacobian_elements = snap_max_jacobian_elements
        self.recurrence: Recurrence | None = None
        # SnAp-n (n >= 2) gathers every y -> h tail onto the neighbourhoods, so it follows a
        # weight that reaches the hidden states through another trainable operation.
        self.include_weight_to_weight = sparse_n is not None and sparse_n >= 2

    @property
    def is_single_step_vjp(self) -> bool:
        return self.vjp_method == "single-step"

    @property
    def is_multi_step_vjp(self) -> bool:
        return self.vjp_method == "multi-step"

    def _compile_kwargs(self) -> _CompileOptions:
        kwargs = _CompileOptions(include_hidden_perturb=self.is_single_step_vjp)
        if self.sparse_n is not None:
            kwargs["sparse_n"] = self.sparse_n
            kwargs["snap_max_jacobian_elements"] = self.snap_max_jacobian_elements
        return kwargs

    def _jacobians(self, env: Mapping[Var, Array]) -> StepJacobians:
        """As the base executor, with SnAp's widened ``D`` and ``df`` and the recurrence applied."""
        jac = super()._jacobians(env)
        widened = [g for g in self.graph.hidden_groups if widens(g)]
        patterned = any(g.snap is not None for g in self.graph.hidden_groups)
        if not patterned and self.recurrence is None:
            return jac
        (xs, dfs), Ds = jac
        dfs, Ds = dict(dfs), list(Ds)
        for group in widened:
            hidden = [env[v] for v in group.hidden_invars]
            inputs = [env[v] for v in group.transition_jaxpr_constvars]
            Ds[group.index] = group.snap_jacobian(hidden, inputs)
            if history_jacobian_key(group) in dfs:
                dfs[history_jacobian_key(group)] = group.snap_jacobian(hidden, inputs, history=True)
        for rel in self.graph.hidden_param_op_relations:
            for i, group in enumerate(rel.hidden_groups):
                if group.snap is None:
                    continue
                moved = _moved_tail_jacobian(rel, i, group.snap, env)
                if widens(group):
                    for key in (df_key(rel, group), detached_df_key(rel, group)):
                        if key in dfs:
                            dfs[key] = pad_states(dfs[key], group.snap.num_neighbour)
                if moved is not None:
                    dfs[df_key(rel, group)] = moved
        if self.recurrence is not None:
            Ds = [self.recurrence(D) for D in Ds]
            for group in self.graph.hidden_groups:
                if history_jacobian_key(group) in dfs:
                    dfs[history_jacobian_key(group)] = self.recurrence(dfs[history_jacobian_key(group)])
        return jax.lax.stop_gradient(((xs, dfs), Ds))


def _moved_tail_jacobian(
    rel: HiddenParamOpRelation, index: int, pattern: SnapPattern, env: Mapping[Var, Array],
) -> Array | None:
    """SnAp's instantaneous term of a relation whose ``y -> h`` tail moves values between positions.

    The tail's Jacobian gathered onto each position's neighbourhood
    (:func:`~braintrace._compiler.snap_pattern.widened_tail_jacobian`), or ``None`` when the tail
    provably keeps every value at its position (``df`` padded into slot 0 is then the same) or
    ``y`` is not laid out over the group's positions.
    """
    group, tail = rel.hidden_groups[index], rel.y_to_hidden_group_jaxprs[index]
    y = env[rel.y_var]
    varshape = tuple(group.varshape)
    if tuple(jnp.shape(y)) != varshape:
        return None
    reach = tail_reach(tail, varshape)
    if reach is not None and all(not np.any(r & ~np.eye(len(r), dtype=bool)) for r in reach):
        return None
    consts = [env[v] for v in tail_constvars(tail)]

    def fn(value: Array) -> Array:
        return group.concat_hidden(jax_compat.eval_jaxpr(tail, consts, value))

    identity = pattern.identity_axes()
    kept = reach is not None and all(
        not np.any(r & ~np.eye(len(r), dtype=bool)) for r, ident in zip(reach, identity) if ident)
    return widened_tail_jacobian(fn, y, pattern, kept)


def widens(group: HiddenGroup) -> bool:
    """Whether a group's per-parameter traces are widened (a SnAp pattern with more than one slot)."""
    return group.snap is not None and not group.snap.is_degenerate


ETraceGraphExecutor.__module__ = "braintrace"
ETraceVjpGraphExecutor.__module__ = "braintrace"
