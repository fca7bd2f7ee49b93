"""The shell and building blocks OTTT and OTPE share: dense relations, a fixed leak, one-state groups.

:class:`DenseLeakRule` is the learners' common shell (their arguments, the relations they
accept, single-step calls, the pull-back of a gradient through a transform hook); the
functions are the pieces their rule records use too (the same checks at a record's ``init``,
the outer product of an input and a signal, the hook pull-back).

Examples
--------
>>> import jax.numpy as jnp
>>> from braintrace._algorithm.rules.dense_leak import outer_sum
>>> outer_sum(jnp.ones((2, 3)), jnp.ones((2, 4)), batched=True).shape  # Σ_b x[b, i] L[b, o]
(3, 4)
"""

from __future__ import annotations

from typing import Mapping, Sequence, cast

import brainstate
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import ETraceVjpAlgorithm, Residual, TraceData
from braintrace._algorithm.engine.input_data import has_multistep_data
from braintrace._algorithm.engine.rule_contract import RelationInfo
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._op._rule_helpers import shape_of
from braintrace._op.dense import etp_mm_p, etp_mv_p
from braintrace._typing import Path, PyTree, WeightFn

__all__ = [
    "DenseLeakRule", "DENSE_PRIMITIVES", "check_mode", "checked_leak", "check_dense_one_state", "through_hook",
    "outer_sum", "leads_with_batch",
]

_DENSE = (etp_mm_p, etp_mv_p)


class DenseLeakRule(ETraceVjpAlgorithm[TraceData, Residual]):
    """The shared shell of OTTT and OTPE: a fixed leak, dense relations, one-state groups,
    single-step calls only.

    Subclasses set :attr:`_modes` and fill in the trace hooks.
    """

    _modes: tuple[str, ...] = ()
    _supports_scan_descent = False

    def __init__(
        self,
        model: brainstate.nn.Module,
        mode: str,
        leak: float,
        name: str | None = None,
        vjp_method: str = "single-step",
        control_flow: ControlFlowPolicy | None = None,
    ) -> None:
        cls = type(self).__name__
        check_mode(mode, self._modes, cls)
        leak = checked_leak(leak, cls)
        if vjp_method != "single-step":
            raise ValueError(
                f"{cls}: only vjp_method='single-step' is supported, got {vjp_method!r}; use D_RTRL "
                f"for multi-step windows."
            )
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow)
        self.mode = mode
        self.leak = leak

    def _check_relations(self) -> None:
        """Dense primitives, one-state groups whose shape is the op's output (at compilation)."""
        cls = type(self).__name__
        for rel in self.graph.hidden_param_op_relations:
            if rel.primitive not in _DENSE:
                raise NotImplementedError(
                    f"{cls} supports dense matmul relations (etp_mm / etp_mv) only, but the weights "
                    f"{sorted(map(str, rel.trainable_paths.values()))} go through {rel.primitive.name}. "
                    f"Use D_RTRL, which handles every primitive."
                )
            for group in rel.hidden_groups:
                if group.num_state != 1:
                    raise ValueError(
                        f"{cls} requires hidden groups with num_state == 1, but group {group.index} "
                        f"({group.hidden_paths}) has num_state == {group.num_state}. Use D_RTRL for "
                        f"multi-state neurons."
                    )
                if tuple(group.varshape) != shape_of(rel.y_var):
                    raise ValueError(
                        f"{cls}: the matmul output {shape_of(rel.y_var)} must have the hidden shape "
                        f"{tuple(group.varshape)} of group {group.index}; use D_RTRL."
                    )

    def update(self, *args: PyTree, **options: object) -> PyTree:
        if has_multistep_data(*args):
            raise NotImplementedError(
                f"{type(self).__name__} v1 supports single-step only: call it once per time step "
                f"(MultiStepData inputs need D_RTRL or pp_prop with vjp_method='multi-step')."
            )
        return super().update(*args, **options)

    def _relation_signal(self, rel: HiddenParamOpRelation, signals: Sequence[jax.Array]) -> jax.Array:
        """``L = Σ_a g[..., a]`` summed over the relation's groups, shaped like ``y``."""
        return sum((signals[g.index].sum(axis=-1) for g in rel.hidden_groups[1:]),
                   signals[rel.hidden_groups[0].index].sum(axis=-1))

    def _add_grads(
        self, rel: HiddenParamOpRelation, effective: dict[str, jax.Array], weight_vals: dict[Path, PyTree],
        grads: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """Pull gradients w.r.t. ``weight_fn(W)`` / ``bias_fn(b)`` back to the raw parameters
        and add them to ``grads``."""
        weights = self._relation_operands(rel, weight_vals)
        for key, g in effective.items():
            if key not in rel.trainable_paths:
                continue
            g = through_hook(key, g, weights, rel.eqn_params)
            grads = self._add_operand_gradient(grads, rel, key, g, weight_vals)
        return grads


#: The dense primitives the fixed-leak rules handle, by name.
DENSE_PRIMITIVES = tuple(p.name for p in _DENSE)


def check_mode(mode: str, modes: Sequence[str], caller: str) -> None:
    """Refuse a ``mode`` outside ``modes``, naming ``caller``."""
    if mode not in modes:
        raise ValueError(f"{caller}: mode must be one of {list(modes)}, got {mode!r}.")


def checked_leak(leak: float, caller: str) -> float:
    """``leak`` as a float, refused unless it is a number with ``0 < leak < 1``."""
    if isinstance(leak, bool) or not isinstance(leak, (int, float)) or not 0.0 < float(leak) < 1.0:
        raise ValueError(
            f"{caller}: leak must be a number with 0 < leak < 1 (the decay of the hidden state, "
            f"e.g. 0.9 for h <- 0.9 h + ...), got {leak!r}."
        )
    return float(leak)


def check_dense_one_state(info: RelationInfo, caller: str) -> None:
    """Refuse a relation outside the fixed-leak rules' scope: not a dense matmul, or driving a
    group of more than one state (a record's ``init``)."""
    if info.primitive not in DENSE_PRIMITIVES:
        raise NotImplementedError(
            f"{caller} supports dense matmul relations ({' / '.join(DENSE_PRIMITIVES)}) only, got a "
            f"{info.primitive} relation. Use braintrace.D_RTRL, which handles every primitive."
        )
    if info.num_state != 1:
        raise ValueError(
            f"{caller} requires hidden groups with one state per unit, but a {info.primitive} relation "
            f"drives a group of num_state == {info.num_state}. Use braintrace.D_RTRL for multi-state "
            f"neurons."
        )


def through_hook(key: str, g: jax.Array, weights: Mapping[str, jax.Array], params: Mapping[str, object]) -> jax.Array:
    """A gradient with respect to the effective operand ``weight_fn(W)`` / ``bias_fn(b)`` pulled back
    to the raw operand ``weights[key]`` (``g`` itself without a hook)."""
    # braintrace.matmul checked that a hook is callable (braintrace._op._operands.check_hook).
    hook = cast("WeightFn | None", params.get("weight_fn" if key == "weight" else "bias_fn"))
    if hook is None:
        return g
    _, vjp = jax.vjp(hook, weights[key])
    pulled: jax.Array = vjp(g.astype(weights[key].dtype))[0]
    return pulled


def outer_sum(x: jax.Array, signal: jax.Array, batched: bool) -> jax.Array:
    """``Σ_b x[b, i] L[b, o]`` (batched) or ``x[i] L[o]``."""
    if batched:
        return jnp.einsum("bi,bo->io", x, signal)
    return jnp.outer(x, signal)


def leads_with_batch(x: jax.Array) -> bool:
    """Whether a dense relation's input (or a trace shaped like it) leads with a batch axis:
    ``etp_mm`` takes ``(batch, in)``, ``etp_mv`` takes ``(in,)``."""
    return x.ndim == 2
