"""Rolling a trace in the backward pass, where its gradient is read in the same pass (TPU, drivers).

A single-step D-RTRL call rolls each trace in its forward pass, ``ε^t = D ε^{t-1} + x ⊗ df``,
and its backward pass reads a trace again for the history term ``⟨Dᵀ g, ε^{t-1}⟩``: three
passes over the trace per step, as the signal ``g`` exists only in the backward pass. When the
learners' own drivers (``etrace_grad``, ``etrace_train``) take the step's gradient, they can
receive the rolled trace from the backward pass instead: the driver hands the call a *sink*
(zeros shaped like the stored traces), the forward pass leaves those traces as they entered,
and the backward pass rolls them and contracts the history in one pass
(:func:`braintrace._op.fused_roll.roll_and_contract`, a Pallas kernel) and returns the rolled
traces as the sink's cotangent, which the driver writes into the trace states. Same maths, the
sums in another order (float32 rounding); two passes over the trace instead of three. A filtered
trace (EProp's ``kappa_filter_decay``, ``ē^t = κ ē^{t-1} + ε^t``, whose gradient reads ``ē^t``)
has its filter rolled by the same pass, the history ``κ ⟨g, ē^{t-1}⟩ + ⟨Dᵀ g, ε^{t-1}⟩``
contracted from both entering arrays (:func:`braintrace._op.fused_roll.roll_filter_and_contract`):
one read and one write of each per step instead of five passes.

It applies on a TPU, where traces of one-state groups are stored without their state axis
(``ParamDimVjpAlgorithm._stored``), to the float32 traces of batched ``matmul`` relations that
roll plainly (single-step D_RTRL, EProp with or without a filter, OSTL), outside a mesh. Every other
call, and every call of a learner outside its drivers (``learner(x)`` under a user's own
``grad``), rolls its traces in the forward pass as before. Inside the driver's ``step_fn``, the
deferred traces read their entering value until the step's gradient is taken.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from braintrace._algorithm.graph_executor import trace_key
from braintrace._op import _registries as reg
from braintrace._op._rule_helpers import mix_states, shape_of

__all__ = ["BackwardRollMixin", "ROLL_MIN_BYTES"]

#: The smallest weight trace (bytes) rolled in the backward pass. On a TPU v5e (batch 32,
#: T = 100) the one-pass kernel took a LIF-1024 D_RTRL step (130 MiB of trace) from 62.8 to
#: 45.5 ms, but made the GRU-256 (two traces, 17 MiB together) and LIF-256 (8.5 MiB) steps 3 and
#: 9 % slower than XLA's fusion, which keeps traces that small in on-chip memory.
ROLL_MIN_BYTES = 64 << 20

class Rolled(NamedTuple):
    """One trace's part of the backward residual."""

    #: The entering trace, in its stored form.
    old: dict[str, jax.Array]
    #: The entering filter of a filtered trace (stored form; ``None``: no filter).
    old_filter: dict[str, jax.Array] | None
    #: The group's Jacobian ``D`` that rolls the trace.
    diag: jax.Array
    #: The relation's input.
    x: jax.Array
    #: The relation's ``df`` (output layout).
    df: jax.Array
    #: The group's history Jacobian.
    history_jacobian: jax.Array


class BackwardRollMixin:
    """The backward roll of ``ParamDimVjpAlgorithm`` (see the module docstring)."""

    _roll_sink: list[Any] | None = None
    _rolled_now: frozenset[Any] = frozenset()
    #: Per trace key the backward pass may roll: the relation's index, the relation, the group
    #: (set with the traces, :meth:`_find_rolled_relations`).
    _rolled_relations: dict[Any, tuple[int, Any, Any]] = {}
    #: The keys the driver's current sink holds, in its order (:meth:`_seq_roll_sink`).
    _sink_keys: tuple[Any, ...] = ()

    def _find_rolled_relations(self) -> dict[Any, tuple[int, Any, Any]]:
        """The keys of :attr:`_rolled_relations`, found from the stored traces."""
        host: Any = self
        filtered = bool(host._trace_filters)
        hooks = ("_trace_for_backward", "_solve_weight_gradients", "_history_trace") + (
            ("_filtered_step",) if filtered else ())
        if not (host._squeezed and host.vjp_method == "single-step" and not host.replaces_signal
                and host._rolls_plainly() and host._defined_in_library(*hooks)):
            return {}
        found = {}
        for index, rel in enumerate(host.graph.hidden_param_op_relations):
            fp = host._fast_path(rel)
            kernel = None if fp is None else (fp.roll_filter_and_solve if filtered else fp.roll_and_solve)
            if (kernel is None or not reg.is_batched_primitive(rel.primitive)
                    or rel.control_flow_context is not None or len(shape_of(rel.x_var)) != 2):
                continue
            for group in rel.hidden_groups:
                key = trace_key(rel, group)
                stored = host.etrace_bwg[key].value
                if (key in host._squeezed and stored["weight"].ndim == 3
                        and all(v.dtype == jnp.float32 for v in stored.values())):
                    found[key] = (index, rel, group)
        return found

    # --- the driver's side ----------------------------------------------------------------

    def _seq_roll_sink(self) -> list[Any] | None:
        """Zeros shaped like each trace the backward pass may roll, in order (``None``: none)."""
        host: Any = self
        if host.sharding_plan is not None:
            return None
        traces = {key: host.etrace_bwg[key].value for key in self._rolled_relations}
        self._sink_keys = tuple(key for key, trace in traces.items()
                                if trace["weight"].size * trace["weight"].dtype.itemsize >= ROLL_MIN_BYTES)
        if not self._sink_keys:
            return None
        sink = [{k: jnp.zeros(v.shape, v.dtype) for k, v in traces[key].items()} for key in self._sink_keys]
        if host._trace_filters:
            return [{"eps": zeros, "filt": jax.tree.map(jnp.zeros_like, zeros)} for zeros in sink]
        return sink

    @contextlib.contextmanager
    def _seq_rolling_into(self, sink: list[Any] | None) -> Iterator[None]:
        """Within this block, the learner's next call rolls its traces into ``sink``'s cotangent."""
        self._roll_sink, self._rolled_now = sink, frozenset()
        try:
            yield
        finally:
            self._roll_sink = None

    def _seq_write_rolled(self, rolled: Sequence[Any]) -> None:
        """Write the traces the backward pass rolled (``rolled``: the sink's cotangent)."""
        host: Any = self
        for key, value in zip(self._sink_keys, rolled):
            if key not in self._rolled_now:
                continue
            if host._trace_filters:
                host.etrace_bwg[key].value = value["eps"]
                host._trace_filters[key].value = value["filt"]
            else:
                host.etrace_bwg[key].value = value

    def _take_roll_sink(self) -> list[Any] | None:
        """The sink of the driver's step for this call (once: a second call gets none)."""
        sink, self._roll_sink = self._roll_sink, None
        return sink

    # --- the learner's side ---------------------------------------------------------------

    def _roll_in_backward(
        self, entering: dict[Any, Any], new: dict[Any, Any], residual: Any, jac: Any,
    ) -> tuple[Any, dict[Any, Any]]:
        """Move the roll of the plainly rolled keys from the forward to the backward pass.

        ``entering`` and ``new`` are the traces as the learner passes them (``{'eps', 'filt'}``
        of a filtered learner). Returns the residual, whose history (and entering filter) no
        longer reads those traces and whose ``rolled`` holds, per key of the sink, what the
        backward pass needs (for a key rolled in the forward pass: zeros, its sink's cotangent),
        and the new traces with the deferred keys as they entered.
        """
        host: Any = self
        filtered = bool(host._trace_filters)
        eps_in, eps_new = (entering["eps"], new["eps"]) if filtered else (entering, new)
        history = residual.trace
        plain = host._plain_rolls(jac, history.through_while)
        local_keys = host._local_relation_weights().keys
        rolled: list[Rolled | dict[str, Any]] = []
        kept, taken = dict(eps_new), set()
        kept_filter = dict(new["filt"]) if filtered else {}
        for key in self._sink_keys:
            index, _, group = self._rolled_relations[key]
            stored = host._stored(key, eps_in[key])
            stored_filter = host._stored(key, entering["filt"][key]) if filtered else None
            # Weights left out of the one-step VJP have a history read off the new trace only.
            if key not in plain or (key not in history.instant and local_keys.get(index)):
                zeros = jax.tree.map(jnp.zeros_like, stored)
                rolled.append({"eps": zeros, "filt": jax.tree.map(jnp.zeros_like, stored)} if filtered else zeros)
                continue
            x, df = plain[key][2]
            rolled.append(Rolled(stored, stored_filter, jac[1][group.index], x, df,
                                 history.history_jacobians[group.index]))
            kept[key] = eps_in[key]
            if filtered:
                kept_filter[key] = entering["filt"][key]
            taken.add(key)
        self._rolled_now = frozenset(taken)
        history = history._replace(
            traces={k: v for k, v in history.traces.items() if k not in taken},
            instant={k: v for k, v in history.instant.items() if k not in taken})
        old_filter = residual.old_filter
        if old_filter is not None:
            old_filter = {k: v for k, v in old_filter.items() if k not in taken}
        residual = residual._replace(trace=history, old_filter=old_filter, rolled=rolled)
        return residual, ({"eps": kept, "filt": kept_filter} if filtered else kept)

    def _solve_rolled(
        self, residual: Any, signals: Sequence[jax.Array], weight_vals: dict[Any, Any], grads: dict[Any, Any],
    ) -> tuple[dict[Any, Any], list[Any] | None]:
        """Roll the traces the ``residual`` deferred and add their history term to ``grads``.

        The history term is the entering trace met by the signal the forward roll's history
        would have met it with: ``Hᵀ g`` (``H`` the group's history Jacobian, ``D`` where the
        history was read off the new trace) or, for a group read past its update, ``∂L/∂h^{t-1}``;
        a filtered trace adds its entering filter met by ``κ g``. Returns the gradients and the
        rolled traces, the roll sink's cotangent (zeros for the keys rolled in the forward pass,
        which the driver does not write; ``None``: no sink).
        """
        rolled: Sequence[Rolled | dict[str, Any]] | None = residual.rolled
        if rolled is None:
            return grads, None
        host: Any = self
        local_keys = host._local_relation_weights().keys
        read_past = residual.trace.read_past_update
        traces: list[Any] = []
        for key, entry in zip(self._sink_keys, rolled):
            index, rel, group = self._rolled_relations[key]
            if not isinstance(entry, Rolled):
                traces.append(entry)
                continue
            g = signals[group.index]
            if group.index in read_past:
                history_signal = read_past[group.index]
            else:
                history_signal = mix_states(jnp.swapaxes(entry.history_jacobian, -1, -2), g)
            fp = host._fast_path(rel)
            diag = rel.output_layout(group, entry.diag)[..., 0, 0]
            signal = rel.output_layout(group, history_signal)[..., 0]
            has_bias = bool(rel.eqn_params.get("has_bias", False))
            if entry.old_filter is None:
                new, history = fp.roll_and_solve(entry.old, diag, entry.x, entry.df[..., 0], signal, has_bias)
                traces.append(new)
            else:
                filt_signal = rel.output_layout(group, host.kappa * g)[..., 0]
                new, new_filter, history = fp.roll_filter_and_solve(
                    entry.old, entry.old_filter, diag, entry.x, entry.df[..., 0], signal, filt_signal,
                    host.kappa, has_bias)
                traces.append({"eps": new, "filt": new_filter})
            covered = local_keys.get(index, frozenset())
            if covered:  # weights left out of the one-step VJP: their gradient is the whole ⟨g, ε^t⟩ (ē^t)
                weights = host._relation_operands(rel, weight_vals)
                same_step = host._solve_instant(rel, rel.output_layout(group, g), entry.x, entry.df, weights)
                history = {k: v + same_step[k] if k in covered else v for k, v in history.items()}
            for k, v in history.items():
                grads = host._add_operand_gradient(grads, rel, k, v, weight_vals)
        return grads, traces
