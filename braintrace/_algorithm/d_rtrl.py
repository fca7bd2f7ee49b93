"""``D_RTRL``: diagonal real-time recurrent learning, a per-parameter eligibility trace.

For every relation (ETP equation ``y = op(x, W)`` driving hidden group ``h``) and trainable key,
the trace ``ε_W ≈ ∂h^t / ∂W`` (one entry per parameter and hidden state, see the primitive's
``init_drtrl``) is rolled forward every step:

``ε^t = D^t ε^{t-1} + diag(df^t) ⊗ x^t``

with ``D^t`` the per-position hidden Jacobian of the group and ``df^t`` the Jacobian of the
``y -> h`` tail. The gradient of a loss at step ``t`` is the exact one-step gradient plus the
history term ``⟨∂L/∂h^t, D^t ε^{t-1}⟩`` (with ``D^t`` taken with in-step reads of other members'
new values held fixed, since ``∂L/∂h^t`` already contains those paths). A weight whose relation
reaches the step's outputs only element-wise through its hidden states
(``braintrace._compiler.local_relation_weights``) has no one-step path besides
``⟨∂L/∂h^t, x^t ⊗ df^t⟩``: it is left out of the one-step VJP and gets ``⟨∂L/∂h^t, ε^t⟩``, the
same sum read off the new trace.

Between sequences, reset the model's states in place (``brainstate.nn.reset_all_states(model)``,
which calls each module's ``reset_state``) and the traces with :meth:`reset_state`; re-running
``init_all_states`` after compiling replaces the state objects the learner was compiled with.

Control flow: a relation inside a descended scan (an inner loop longer than
``ControlFlowPolicy.scan_unroll_limit``) folds its trace over the ``L`` substeps of every step,
``ε ← D_τ ε + x_τ ⊗ df_τ``, and its single-step history goes through the substep product
``D_L…D_1``. A tail that crosses a hidden-producing ``while_loop`` (detached in the perturbed
step) gets its same-step credit through that loop from the trace.

Exactness: equal to backpropagation through time, element-wise, when the true hidden Jacobian
is the compiled per-position ``D`` (element-wise leaks, LIF neurons driven by ETP operations,
no hidden mixing through weights) and the tail is element-wise. Otherwise it is an
approximation that drops cross-position (weight-mixing) recurrence from the trace.

Examples
--------
>>> import brainstate, jax, jax.numpy as jnp, braintrace
>>> class Leaky(brainstate.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = brainstate.ParamState(jnp.ones((3, 2)))
...         self.h = brainstate.HiddenState(jnp.zeros(2))
...     def update(self, x):
...         self.h.value = 0.5 * self.h.value + braintrace.matmul(x, self.w.value)
...         return self.h.value
>>> learner = braintrace.compile(Leaky(), braintrace.D_RTRL, jnp.ones(3))
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('w',)].shape
(3, 2)
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Sequence

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.graph_executor import detached_df_key, df_key, history_jacobian_key, trace_key
from braintrace._algorithm.input_data import get_single_step_data
from braintrace._compiler import ControlFlowPolicy
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import mix_states

__all__ = ["ParamDimVjpAlgorithm", "D_RTRL", "init_rule_kwargs"]

Path = tuple[Any, ...]
Trace = dict[str, jax.Array]


def init_rule_kwargs(rule: Any, **available: Any) -> dict[str, Any]:
    """The optional context (``group=``, ``eqn_params=``) an init rule declares it accepts."""
    try:
        params = inspect.signature(rule).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(available)
    return {k: v for k, v in available.items() if k in params}


def transpose_signal(signal: jax.Array, diag: jax.Array) -> jax.Array:
    """``Dᵀ g`` per position: ``g'[..., c] = Σ_a g[..., a] D[..., a, c]``."""
    return mix_states(jnp.swapaxes(diag, -1, -2), signal)


class BackwardTrace(NamedTuple):
    """What the D-RTRL backward pass contracts the hidden-state signal with.

    Attributes
    ----------
    traces : dict
        Per trace key, the trace entering the step, or, for keys in ``instant``, the new trace.
    history_jacobians : list or None
        Per hidden group, the Jacobian ``D`` the signal is transposed by before it meets an
        entering trace (``None``: contract the signal with the traces as they are).
    through_while : dict
        Per trace key, the ``(x, df)`` of a tail part that crosses a detached ``while_loop``.
    instant : dict
        Per trace key whose ``traces`` entry is the new trace, the ``(x, df)`` of its
        instantaneous term ``x ⊗ df``, subtracted to leave the history ``D ε^{t-1}``.
    read_past_update : dict
        Per index of a group whose previous value the step reads past its update, the signal
        ``∂L/∂h^{t-1}`` (through every path) that meets the entering trace instead of ``Dᵀ g``.
    """

    traces: dict[Any, Trace]
    history_jacobians: list[Any] | None
    through_while: dict[Any, tuple[Any, jax.Array]] = {}
    instant: dict[Any, tuple[Any, jax.Array]] = {}
    read_past_update: dict[int, jax.Array] = {}


class ParamDimVjpAlgorithm(ETraceVjpAlgorithm):
    """D-RTRL: the eligibility trace has the dimension of the parameters (see the module docstring).

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
    fast_solve : bool
        Use the primitive's closed-form kernels when it has them and no transform hook is active.
    trace_dtype : dtype, optional
        Storage dtype of fast-path traces (e.g. ``jnp.bfloat16``); the math stays in the
        parameters' precision.
    chunked_trace : bool
        Roll multi-step windows in closed form where the kernels allow it.
    control_flow : ControlFlowPolicy, optional

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.ParamDimVjpAlgorithm,
    ...                              jnp.ones(3))
    >>> loss = lambda x: learner(x).sum()
    >>> for t in range(3):  # one gradient per time step; the trace carries the history
    ...     grads = brainstate.transform.grad(loss, learner.param_states)(jnp.ones(3))
    >>> grads[('W', 'weight')]['weight'].shape
    (7, 4)
    >>> trace, = learner.get_etrace_of(learner.param_states[('W', 'weight')]).values()
    >>> trace['weight'].shape  # one entry per parameter and hidden state
    (7, 4, 1)
    """

    _supports_scan_descent = True
    _history_holds_same_step = True

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "single-step",
        fast_solve: bool = True,
        trace_dtype: Any = None,
        chunked_trace: bool = True,
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self.fast_solve = bool(fast_solve)
        self.trace_dtype = None if trace_dtype is None else jnp.dtype(trace_dtype)
        self.chunked_trace = bool(chunked_trace)
        self.etrace_bwg: dict[Any, EligibilityTrace] = {}

    # --- trace storage --------------------------------------------------------------------

    def _fast_path(self, rel: Any) -> reg.FastPathRules | None:
        fp = reg.get_fast_path_rules(rel.primitive)
        if self.fast_solve and fp is not None and fp.applicable(rel.eqn_params):
            return fp
        return None

    def init_etrace_state(self, *args: Any, **kwargs: Any) -> None:
        """Allocate a zero trace per (relation, hidden group)."""
        traces: dict[Any, EligibilityTrace] = {}
        for rel in self.graph.hidden_param_op_relations:
            init = reg.ETP_RULES_INIT_DRTRL[rel.primitive]
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                if key in traces:
                    raise ValueError(f"The relation {rel} has been added.")
                extra = init_rule_kwargs(init, group=group, eqn_params=rel.eqn_params)
                value = init(rel.x_var, rel.y_var, rel.trainable_vars, self._trace_width(group), **extra)
                if not isinstance(value, dict):
                    raise TypeError(
                        f"init_drtrl of {rel.primitive.name} must return a dict of traces, got "
                        f"{type(value).__name__}."
                    )
                if self.trace_dtype is not None and self._fast_path(rel) is not None:
                    value = {k: v.astype(self.trace_dtype) for k, v in value.items()}
                traces[key] = EligibilityTrace(value)
        self.etrace_bwg = traces
        self._allocate_final_shapes(*args)

    def _allocate_final_shapes(self, *args: Any) -> None:
        """Re-allocate traces that one step would broadcast to a larger shape.

        An operation that sees no batch axis (``matmul`` of an unbatched input) driving a
        batched hidden group gets one trace per sample once the group's per-sample Jacobian
        meets it. The step is evaluated abstractly here, so every trace starts at the shape it
        keeps and a scan can carry it.
        """
        if not args:
            return
        ex = self.vjp_executor
        state_vals = {p: st.value for p, st in ex.states.items()}
        weight_vals = {p: state_vals[p] for p in self.param_states}

        def one_step() -> dict[Any, Trace]:
            _, _, env = ex.run_step(get_single_step_data(*args), state_vals)
            (xs, dfs), Ds = ex.extract_jacobians(env)
            return self._step_all({k: st.value for k, st in self.etrace_bwg.items()}, xs, dfs, Ds, weight_vals)

        stepped = jax.eval_shape(one_step)
        for key, st in self.etrace_bwg.items():
            grown = {k: v for k, v in stepped[key].items() if v.shape != st.value[k].shape}
            if grown:
                st.value = {k: jnp.zeros(grown[k].shape, v.dtype) if k in grown else v for k, v in st.value.items()}

    def _trace_width(self, group: Any) -> int:
        """The trailing axis of a group's traces: its number of states (a wider scope widens it)."""
        return int(group.num_state)

    def _get_etrace_data(self) -> dict[Any, Trace]:
        return {k: st.value for k, st in self.etrace_bwg.items()}

    def _assign_etrace_data(self, etrace_vals: dict[Any, Trace]) -> None:
        for k, v in etrace_vals.items():
            self.etrace_bwg[k].value = v

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        """Zero every trace and the step counter (model states are not touched).

        With ``batch_size``, every trace that leads with the batch axis of its hidden group gets
        that leading size (see :meth:`HiddenParamOpRelation.traces_lead_with_batch`); the others
        keep their shape. The learner stays compiled for its example's shapes: calls at another
        batch size need a learner compiled for it.
        """
        self.running_index.value = jnp.zeros_like(self.running_index.value)
        batched = {
            trace_key(rel, g): rel.traces_lead_with_batch(g)
            for rel in self.graph.hidden_param_op_relations for g in rel.hidden_groups
        }
        for key, st in self.etrace_bwg.items():
            def zeros(v: jax.Array, resize: bool = batched.get(key, False)) -> jax.Array:
                shape = (batch_size, *v.shape[1:]) if (batch_size is not None and resize) else v.shape
                return jnp.zeros(shape, v.dtype)

            st.value = jax.tree.map(zeros, st.value)

    def get_etrace_of(self, weight: Any) -> dict[Any, Trace]:
        """The traces of every relation that has ``weight`` (a ``ParamState`` or its path) as a key.

        Each relation's whole trace: one entry per trainable key (``'weight'``, ``'bias'``, ...),
        whichever of its parameters is asked for.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        found = {}
        for rel in self.graph.hidden_param_op_relations:
            if path in rel.trainable_paths.values():
                for g in rel.hidden_groups:
                    found[trace_key(rel, g)] = dict(self.etrace_bwg[trace_key(rel, g)].value)
        if not found:
            shown = f"a {type(weight).__name__} that is not a state of this model" if path is None else path
            raise ValueError(
                f"get_etrace_of: there is no etrace of the given weight ({shown}). Only the weights "
                f"of compiled relations (ETP operations that drive hidden states) have traces; "
                f"learner.report lists them."
            )
        return found

    def _relation_etrace(self, rel: Any, group: Any) -> Trace:
        return dict(self.etrace_bwg[trace_key(rel, group)].value)

    # --- one step of the trace ------------------------------------------------------------

    def _step_relation(
        self, rel: Any, group: Any, old: Trace, diag: jax.Array, x: Any, df: jax.Array, weights: Trace
    ) -> Trace:
        diag, df = rel.output_layout(group, diag), rel.output_layout(group, df)
        num_state = diag.shape[-1]  # the trace's trailing width (see _trace_width)
        fp = self._fast_path(rel)
        if fp is not None:
            math_dtype = jnp.result_type(*[w.dtype for w in weights.values()], df.dtype)
            old_m = {k: v.astype(math_dtype) for k, v in old.items()}
            new = fp.recurrent(diag, old_m, num_state)
            inst = fp.instant(x, df, bool(rel.eqn_params.get("has_bias", False)))
            return {k: (new[k] + inst[k]).astype(old[k].dtype) for k in old}
        recurrent = self._general_recurrent(rel, diag, old, num_state)
        inst = self._general_instant(rel, x, df, weights)
        return {k: (recurrent[k] + inst[k]).astype(old[k].dtype) for k in old}

    @staticmethod
    def _general_recurrent(rel: Any, diag: jax.Array, old: Trace, num_state: int) -> Trace:
        dt_to_t = reg.ETP_RULES_DT_TO_T[rel.primitive]
        rows = []
        for a in range(num_state):
            terms = [
                dt_to_t(diag[..., a, c], {k: v[..., c] for k, v in old.items()}, **rel.eqn_params)
                for c in range(num_state)
            ]
            rows.append({k: sum(t[k] for t in terms) for k in old})
        return {k: jnp.stack([r[k] for r in rows], axis=-1) for k in old}

    @staticmethod
    def _general_instant(rel: Any, x: Any, df: jax.Array, weights: Trace) -> Trace:
        rule = reg.get_instant_drtrl_rule(rel.primitive) or reg.ETP_RULES_XY_TO_DW[rel.primitive]

        def one_state(d: jax.Array) -> Trace:
            if reg.is_batched_primitive(rel.primitive):
                return jax.vmap(lambda xb, db: rule(xb, db, weights, **rel.eqn_params))(x, d)
            return rule(x, d, weights, **rel.eqn_params)

        out: Trace = jax.vmap(one_state, in_axes=-1, out_axes=-1)(df)
        return out

    def _step_all(
        self, etrace: dict[Any, Trace], xs: dict[int, Any], dfs: dict[Any, Any], Ds: Sequence[Any], weight_vals: Any
    ) -> dict[Any, Trace]:
        new = dict(etrace)
        for rel in self.graph.hidden_param_op_relations:
            weights = self._relation_operands(rel, weight_vals)
            x = None if rel.x_var is None else xs[id(rel.x_var)]
            step = self._fold_substeps if rel.control_flow_context is not None else self._step_relation
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                new[key] = step(rel, group, etrace[key], Ds[group.index], x, dfs[df_key(rel, group)], weights)
        return new

    def _fold_substeps(
        self, rel: Any, group: Any, old: Trace, diag_seq: jax.Array, x_seq: Any, df_seq: jax.Array, weights: Trace
    ) -> Trace:
        """One step of a relation inside a descended scan: the trace folded over its ``L`` substeps.

        ``ε ← D_τ ε + x_τ ⊗ df_τ`` for ``τ = 1..L``, with the stacked per-substep values.
        """

        def substep(eps: Trace, values: Any) -> tuple[Trace, None]:
            diag, x, df = values
            return self._step_relation(rel, group, eps, diag, x, df, weights), None

        new, _ = jax.lax.scan(substep, old, (diag_seq, x_seq, df_seq))
        return new

    def _through_while(self, h2w: Any) -> dict[Any, tuple[Any, jax.Array]]:
        """``(x, df through while)`` per trace key whose tail crosses a detached ``while_loop``.

        The perturbed step cuts reverse mode at such loops, so the one-step gradient lacks the
        same-step credit ``⟨g, x ⊗ df⟩`` of that part of the tail; the backward adds it.
        """
        xs, dfs = h2w
        found = {}
        for rel in self.graph.hidden_param_op_relations:
            for group in rel.hidden_groups:
                key = detached_df_key(rel, group)
                if key in dfs:
                    x = None if rel.x_var is None else xs[id(rel.x_var)]
                    found[trace_key(rel, group)] = (x, dfs[key])
        return found

    def _history_jacobians(self, Ds: Sequence[Any], h2w: dict[Any, Any]) -> list[Any]:
        """Per group, the ``∂h^t/∂h^{t-1}`` the single-step history term contracts the signal with.

        ``D``; for a descended group the substep product ``D_L…D_1``; for a group whose members
        read each other's new values within the step, the partial Jacobian with those reads held
        fixed (the perturbation signal already carries those in-step paths).
        """
        out = []
        for group, D in zip(self.graph.hidden_groups, Ds):
            if group.descent is not None:
                out.append(substep_product(D))
            else:
                out.append(h2w.get(history_jacobian_key(group), D))
        return out

    def _update_etrace_data(
        self, running_index: Any, etrace_vals_util_t_1: Any, hid2weight_jac_single_or_multi_times: Any,
        hid2hid_jac_single_or_multi_times: Any, weight_vals: Any, input_is_multi_step: bool,
    ) -> dict[Any, Trace]:
        xs, dfs = hid2weight_jac_single_or_multi_times
        Ds = hid2hid_jac_single_or_multi_times
        if not input_is_multi_step:
            return self._step_all(etrace_vals_util_t_1, xs, dfs, Ds, weight_vals)
        return self._roll_window(etrace_vals_util_t_1, xs, dfs, Ds, weight_vals)

    def _roll_window(self, etrace: dict[Any, Trace], xs: Any, dfs: Any, Ds: Any, weight_vals: Any) -> dict[Any, Trace]:
        """Roll the trace over a window of stacked Jacobians (closed form where possible)."""
        chunkable, rest = self._chunk_split()
        new = dict(etrace)
        if self.chunked_trace and chunkable:
            new.update(self._chunk_roll(etrace, xs, dfs, Ds, chunkable))
        else:
            rest = rest + chunkable

        if rest:
            keys = [trace_key(r, g) for r in rest for g in r.hidden_groups]

            def body(carry: dict[Any, Trace], jac: Any) -> tuple[dict[Any, Trace], None]:
                (x_t, df_t, D_t) = jac
                stepped = self._step_all({**etrace, **carry}, x_t, df_t, D_t, weight_vals)
                return {k: stepped[k] for k in keys}, None

            rolled, _ = jax.lax.scan(body, {k: etrace[k] for k in keys}, (xs, dfs, Ds))
            new.update(rolled)
        return new

    def _chunk_split(self) -> tuple[list[Any], list[Any]]:
        chunkable: list[Any] = []
        rest: list[Any] = []
        for rel in self.graph.hidden_param_op_relations:
            fp = self._fast_path(rel)
            ok = fp is not None and fp.chunk is not None and rel.control_flow_context is None
            (chunkable if ok else rest).append(rel)
        return chunkable, rest

    def _chunk_roll(self, etrace: dict[Any, Trace], xs: Any, dfs: Any, Ds: Any, relations: list[Any]) -> dict[Any, Trace]:
        suffix: dict[int, tuple[jax.Array, jax.Array]] = {}
        out = {}
        for rel in relations:
            fp = self._fast_path(rel)
            assert fp is not None and fp.chunk is not None
            x_seq = None if rel.x_var is None else xs[id(rel.x_var)]
            for group in rel.hidden_groups:
                if group.index not in suffix:
                    suffix[group.index] = suffix_products(Ds[group.index])
                p_seq, m_full = suffix[group.index]
                key = trace_key(rel, group)
                old = etrace[key]
                df_seq = rel.output_layout(group, dfs[df_key(rel, group)], lead=1)
                old_m = {k: v.astype(df_seq.dtype) for k, v in old.items()}
                new = fp.chunk(x_seq, df_seq, rel.output_layout(group, p_seq, lead=1),
                               rel.output_layout(group, m_full), old_m, df_seq.shape[-1])
                out[key] = {k: new[k].astype(old[k].dtype) for k in old}
        return out

    def _make_etrace_stepper(self, weight_vals: Any) -> Any:
        if self.chunked_trace:
            return None

        def stepper(carry: dict[Any, Trace], jac: Any) -> tuple[dict[Any, Trace], None]:
            xs, dfs, Ds = jac
            return self._step_all(carry, xs, dfs, Ds, weight_vals), None

        return stepper

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(self, old_etrace: Any, new_etrace: Any, jac: Any, single_step: bool) -> Any:
        # Single step: the one-step autodiff gradient already holds the instantaneous term, so
        # the trace contributes its history ⟨g, D ε^{t-1}⟩. Where the trace was rolled with that
        # same D by a fast path, D ε^{t-1} is ε^t − x ⊗ df: reading the new trace leaves the old
        # one a single reader (the update, which then runs in place) and needs no transposed signal.
        # Elsewhere the history is ⟨Dᵀ g, ε^{t-1}⟩, with the history Jacobian (a descended group's
        # substep product; the partial Jacobian of a group whose members read each other's new
        # values).
        if not single_step:
            return BackwardTrace(old_etrace, None)
        (xs, dfs), Ds = jac
        history = self._history_jacobians(Ds, dfs)
        through_while = self._through_while(jac[0])
        read_past = self._groups_read_past_update()
        traces, instant = dict(old_etrace), {}
        relations = self.graph.hidden_param_op_relations if self._rolls_plainly() else []
        for rel in relations:
            if self._fast_path(rel) is None or rel.control_flow_context is not None:
                continue
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                simple = history[group.index] is Ds[group.index] and group.index not in read_past
                if simple and key not in through_while:
                    traces[key] = new_etrace[key]
                    x = None if rel.x_var is None else xs[id(rel.x_var)]
                    instant[key] = (x, rel.output_layout(group, dfs[df_key(rel, group)]))
        return BackwardTrace(traces, history, through_while, instant)

    def _same_step_in_history(self, rel: Any) -> bool:
        # The history is read off the new trace (ε^t − x ⊗ df) only for fast-path relations of
        # plainly rolled traces whose groups contract the signal with D itself.
        return (
            self._rolls_plainly()
            and self._defined_in_library("_solve_history_from_new", "_solve_relation")
            and self._fast_path(rel) is not None
            and all(g.descent is None and not g.reads_new_members() for g in rel.hidden_groups)
        )

    def _rolls_plainly(self) -> bool:
        """Whether new traces are the plain roll ``D ε + x ⊗ df`` of the entering ones.

        Only then is ``ε^t − x ⊗ df`` the history ``D ε^{t-1}``. The library's rules roll plainly;
        a subclass defined elsewhere that overrides how traces are rolled (to clip or filter
        them) gets the history from the entering trace, as the rolled-trace hooks describe.
        """
        return self._defined_in_library("_update_etrace_data", "_step_all", "_step_relation")

    def _with_previous_signal(self, trace_for_bwd: Any, previous: list[Any]) -> Any:
        read_past = self._groups_read_past_update()
        if not read_past:
            return trace_for_bwd
        return BackwardTrace(*trace_for_bwd)._replace(read_past_update={i: previous[i] for i in read_past})

    def _solve_weight_gradients(
        self, running_index: Any, etrace_h2w_at_t: Any, dl_to_hidden_groups: Sequence[Any],
        weight_vals: dict[Path, Any], dl_to_nonetws_at_t: dict[Path, Any], dl_to_etws_at_t: dict[Path, Any],
    ) -> dict[Path, Any]:
        etrace, Ds, through_while, instant, read_past = BackwardTrace(*etrace_h2w_at_t)
        grads = dict(dl_to_etws_at_t)
        local_keys = self._local_relation_weights().keys
        for index, rel in enumerate(self.graph.hidden_param_op_relations):
            weights = self._relation_operands(rel, weight_vals)
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                signal = dl_to_hidden_groups[group.index]
                if key in instant:
                    per_key = self._solve_history_from_new(
                        rel, rel.output_layout(group, signal), etrace[key], *instant[key], weights,
                        local_keys.get(index, frozenset()))
                elif group.index in read_past:
                    previous = rel.output_layout(group, read_past[group.index])
                    per_key = self._solve_relation(rel, previous, etrace[key], weights)
                else:
                    if Ds is not None:
                        signal = transpose_signal(signal, Ds[group.index])
                    per_key = self._solve_relation(rel, rel.output_layout(group, signal), etrace[key], weights)
                if key in through_while:
                    x, df = through_while[key]
                    zero = {k: jnp.zeros_like(v) for k, v in etrace[key].items()}
                    no_history = jnp.zeros((*df.shape, df.shape[-1]), df.dtype)
                    inst = self._step_relation(rel, group, zero, no_history, x, df, weights)
                    current = rel.output_layout(group, dl_to_hidden_groups[group.index])
                    extra = self._solve_relation(rel, current, inst, weights)
                    per_key = {k: per_key[k] + extra[k] for k in per_key}
                for k, g in per_key.items():
                    grads = self._add_operand_gradient(grads, rel, k, g, weight_vals)
        return grads

    def _solve_history_from_new(
        self, rel: Any, signal: jax.Array, new: Trace, x: Any, df: jax.Array, weights: Trace,
        covered: frozenset[str] = frozenset(),
    ) -> Trace:
        """``⟨g, D ε^{t-1}⟩ = ⟨g, ε^t⟩ − ⟨g, x ⊗ df⟩`` for a trace rolled by a fast path.

        For the ``covered`` keys (weights left out of the one-step VJP) the whole ``⟨g, ε^t⟩``
        is the gradient. The barrier keeps XLA from recomputing ``ε^t`` from ``ε^{t-1}`` inside
        the contraction, which would give the entering trace a second reader and cost a copy of it.
        """
        fp = self._fast_path(rel)
        assert fp is not None
        total = self._solve_relation(rel, signal, jax.lax.optimization_barrier(new), weights)
        if not set(total) - covered:
            return total
        inst = fp.instant(x, df, bool(rel.eqn_params.get("has_bias", False)))
        current = self._solve_relation(rel, signal, inst, weights)
        return {k: v if k in covered else v - current[k] for k, v in total.items()}

    def _solve_relation(self, rel: Any, signal: jax.Array, trace: Trace, weights: Trace) -> Trace:
        fp = self._fast_path(rel)
        batched = reg.is_batched_primitive(rel.primitive)
        if fp is not None:
            result: Trace = fp.solve(signal, trace, fold_batch=batched)
            return result
        solve_rule = reg.get_solve_drtrl_rule(rel.primitive)
        dt_to_t = reg.ETP_RULES_DT_TO_T[rel.primitive]

        def solve(g: jax.Array, tr: Trace) -> Trace:
            parts = []
            for a in range(g.shape[-1]):
                sl = {k: v[..., a] for k, v in tr.items()}
                if solve_rule is not None:
                    parts.append(solve_rule(g[..., a], sl, weights, **rel.eqn_params))
                else:
                    parts.append(dt_to_t(g[..., a], sl, **rel.eqn_params))
            return {k: sum(p[k] for p in parts) for k in tr}

        if batched:
            return {k: v.sum(axis=0) for k, v in jax.vmap(solve)(signal, trace).items()}
        return solve(signal, trace)


def suffix_products(Ds: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``P_s = D_{T-1}…D_{s+1}`` (``P_{T-1} = I``) and ``M = D_{T-1}…D_0`` for stacked ``D``.

    ``Ds`` is ``(T, ..., S, S)``; an associative scan keeps the temporal order and needs no
    division (exact for zero decays).
    """
    num_state = Ds.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(num_state, dtype=Ds.dtype), Ds.shape[1:])
    # shifted[s] = D_{s+1} (identity past the end); suffix products of it give P_s.
    shifted = jnp.concatenate([Ds[1:], eye[None]], axis=0)
    if num_state == 1:
        prods = jax.lax.cumprod(shifted, axis=0, reverse=True)
    else:
        prods = jax.lax.associative_scan(lambda a, b: a @ b, shifted, reverse=True)
    full = prods[0] @ Ds[0] if num_state > 1 else prods[0] * Ds[0]
    return prods, full


def substep_product(Ds: jax.Array) -> jax.Array:
    """``D_{L-1}…D_0`` of stacked per-position Jacobians ``(L, ..., S, S)``: ``(..., S, S)``."""
    if Ds.shape[-1] == 1:
        return jnp.prod(Ds, axis=0)

    def fold(acc: jax.Array, D: jax.Array) -> tuple[jax.Array, None]:
        return D @ acc, None

    eye = jnp.broadcast_to(jnp.eye(Ds.shape[-1], dtype=Ds.dtype), Ds.shape[1:])
    return jax.lax.scan(fold, eye, Ds)[0]


class D_RTRL(ParamDimVjpAlgorithm):
    """D-RTRL under its canonical name (identical to :class:`ParamDimVjpAlgorithm`).

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'single-step', 'multi-step'}
        The estimator (see :class:`~braintrace.ETraceVjpAlgorithm`).
    fast_solve : bool
        Use the primitive's closed-form kernels when the library's rules are in force.
    trace_dtype : dtype, optional
        Storage dtype of fast-path traces.
    chunked_trace : bool
        Roll multi-step windows in closed form where the kernels allow it.
    control_flow : ControlFlowPolicy, optional

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3))
    >>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
    >>> {path: g['weight'].shape for path, g in grads.items()}
    {('W', 'weight'): (7, 4)}
    >>> issubclass(braintrace.D_RTRL, braintrace.ParamDimVjpAlgorithm)
    True
    """
