"""``RandomProjectionVjpAlgorithm``: a rank-one, unbiased estimate of the influence matrix.

Real-time recurrent learning carries the influence ``ε^t = ∂h^t/∂θ`` of the parameters on
each hidden group, ``ε^t = D^t ε^{t-1} + J_f^t``, with ``D`` the whole within-group hidden
Jacobian and ``J_f = ∂h^t/∂θ`` at fixed ``h^{t-1}``. Unbiased online recurrent optimisation
(Tallec & Ollivier, 2018) keeps instead one pair of factors per group, ``ε̃ = s̃ θ̃ᵀ``: a
hidden-shaped ``s̃`` ``(*varshape, S)`` and, per parameter the group's relations learn, a
parameter-shaped ``θ̃``. Every step draws a Rademacher vector ``ν`` (entries ±1) per group and

.. code-block:: text

    proj = νᵀ J_f                              per parameter, by the primitive's own rules
    ds   = D · s̃                               a JVP of the group's transition (matrix-free)
    rho0 = sqrt((‖θ̃‖ + eps) / (‖ds‖ + eps))     ‖θ̃‖ over all parameters of the group
    rho1 = sqrt((‖proj‖ + eps) / (‖ν‖ + eps))
    s̃   ← rho0 · ds + rho1 · ν
    θ̃   ← θ̃ / rho0 + proj / rho1

The new product is ``D ε̃ + ν νᵀ J_f`` plus two cross terms odd in ``ν`` (``rho1`` is even), so
``E[ε̃^t]`` is the exact within-group influence of the compiled transition: on a model with one
hidden group the gradient is an unbiased estimate of backpropagation through time. The
normalisers only shape the variance. Cross-group influence is not represented.

The projection ``νᵀ J_f`` of a relation is the primitive's weight-gradient rule ``xy_to_dw`` at
the cotangent ``νᵀ ∂h/∂y``, one VJP of the relation's ``y -> h`` tail. So it holds for any tail:
one that rolls or mixes positions, and one that crosses another trainable operation (the graph
is compiled with ``include_weight_to_weight=True``: a GRU's reset gate, which reaches ``h``
only through the candidate's weight, learns through its factors too).

The gradient of a call adds, for each group, ``⟨∂L/∂h, s̃⟩ · θ̃`` with ``∂L/∂h`` the signal at
the state entering the call (the hidden state the trace describes) to the call's exact
gradient (the window's backpropagation for ``vjp_method='multi-step'``, the one-step gradient
for ``'single-step'``).

The per-group maths (the draw, the projection, the transition both ways, the factors' update)
are the functions of :mod:`~braintrace._algorithm.rules.projection_rule`, whose record
``braintrace.uoro_rule`` runs them on one carrier per group; the engine keeps one factor per
parameter, windows of steps and the signal at ``h^{t-1}`` through every path of the step.

The transition is applied matrix-free: ``D · s̃`` is one JVP of the group's transition at the
step's values (:func:`transition_jvp`), so the dense ``(P·S)²`` Jacobian is never built. The
carrier holds ``|θ| + P·S`` numbers per group (``P`` including any batch); a step forms no
larger intermediate than the projection ``|θ|`` itself. Under ``braintrace.compile(..., vmap=True)`` every lane carries its
own factors while the key and step counter are shared, so the lanes draw the same signs.

Examples
--------
>>> import brainstate, jax.numpy as jnp, braintrace
>>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.RandomProjectionVjpAlgorithm,
...                              jnp.ones(3))
>>> grads = brainstate.transform.grad(lambda x: learner(x).sum(), learner.param_states)(jnp.ones(3))
>>> grads[('W', 'weight')]['weight'].shape
(7, 4)
>>> carrier = learner._get_etrace_data()
>>> carrier['s_tilde'][0].shape, carrier['theta_tilde'][(0, ('W', 'weight'))]['weight'].shape
((4, 1), (7, 4))
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence, TypedDict, TypeGuard

import brainstate
import brainunit as u
import jax
import jax.numpy as jnp

from braintrace._algorithm.engine.base import EligibilityTrace, ETraceVjpAlgorithm
from braintrace._algorithm.carriers.carrier_store import CarrierStore, TraceStore
from braintrace._algorithm.engine.config import ETraceConfig, engine_config
from braintrace._algorithm.engine.graph_executor import (
    CallHiddenJacobians,
    CallJacobians,
    CallWeightJacobians,
    DfKey,
    TailPoint,
    TransitionPoint,
    df_key,
)
from braintrace._algorithm.rules.projection_rule import (
    checked_eps,
    key_data,
    projection_update,
    rademacher_draw,
    relation_projection,
    transition_jvp,
)
from braintrace._compiler import ControlFlowPolicy
from braintrace._compiler.hid_param_op import HiddenParamOpRelation
from braintrace._compiler.hidden_group import HiddenGroup
from braintrace._compiler.jaxpr_graph import contains_eqn
from braintrace._errors import internal_error
from braintrace._typing import Path, PyTree

__all__ = ["RandomProjectionVjpAlgorithm", "ProjectionCarrier"]

#: ``(hidden group index, parameter path)``: the key of one parameter factor ``θ̃``.
FactorKey = tuple[int, Path]


class ProjectionCarrier(TypedDict):
    """The state a random-projection learner carries from step to step.

    Attributes
    ----------
    s_tilde : dict
        Per hidden group index, the hidden factor ``s̃`` ``(*varshape, S)``, at the hidden dtype.
    theta_tilde : dict
        Per ``(group index, parameter path)``, the parameter factor ``θ̃``: the parameter's
        pytree of mantissas (its unit is re-attached by :meth:`~RandomProjectionVjpAlgorithm.get_etrace_of`).
    key : array
        The PRNG key (raw ``uint32`` key data) the next step's draws are split from.
    step : array
        ``int32``: the number of steps rolled since the last reset.
    """

    s_tilde: dict[int, jax.Array]
    theta_tilde: dict[FactorKey, PyTree]
    key: jax.Array
    step: jax.Array


class RelationFactors(TypedDict):
    """One relation's factors for one group (:meth:`~RandomProjectionVjpAlgorithm._relation_etrace`)."""

    #: The group's hidden factor ``s̃`` ``(*varshape, S)``.
    s_tilde: jax.Array
    #: Per credited parameter path, its factor ``θ̃`` (shaped and unit-carrying like the parameter).
    theta_tilde: dict[Path, PyTree]


#: Per df key, a relation's :class:`TailPoint` (``df`` itself for a relation under control flow).
ProjectionTails = Mapping[DfKey, jax.Array | TailPoint]
#: ``(xs, tail points, transition points)`` of one step in the executor's scan.
ProjectionStep = tuple[dict[int, jax.Array], ProjectionTails, Sequence[TransitionPoint]]
#: ``stepper(carrier, step) -> (carrier, None)``: one step of the factors in a scan.
ProjectionStepper = Callable[[ProjectionCarrier, ProjectionStep], tuple[ProjectionCarrier, None]]


class BoundaryTerm(NamedTuple):
    """What the backward pass contracts: the carrier entering the call and, single step, ``∂L/∂h^{t-1}``."""

    carrier: ProjectionCarrier
    previous: list[jax.Array] | None = None


class RandomProjectionVjpAlgorithm(ETraceVjpAlgorithm[ProjectionCarrier, BoundaryTerm]):
    """The random-projection (rank-one factor) trace engine; see the module docstring.

    Parameters
    ----------
    model : brainstate.nn.Module
    name : str, optional
    vjp_method : {'multi-step', 'single-step'}
        ``'multi-step'`` (default): a call may be a window of steps, differentiated exactly
        inside; the factors entering it meet ``∂L/∂h`` at its entry. ``'single-step'``: one step
        per call; the factors meet ``∂L/∂h^{t-1}`` of the step's loss.
    fast_solve : bool
        Accepted for the engine signature; a projection is one evaluation of the primitive's
        ``xy_to_dw`` rule, with no closed-form alternative to choose between.
    control_flow : ControlFlowPolicy, optional
    config : ETraceConfig, optional
        The coordinate; default (and the only one this engine realises)
        ``ETraceConfig(trace_factorization='random_projection', recurrence_scope='coupled')``.
        Another factorization or a learning signal other than ``'symmetric'`` is refused.
    projection_key : int or key array
        Seed (or key) of the Rademacher draws; :meth:`reset_state` re-derives the key from it.
    projection_eps : float
        The normalisers' regulariser; must be positive, also in float32.
    random_feedback_key : int or key array, optional
        Key of the fixed feedback matrices of a ``random_feedback`` learning signal (kept for
        the coordinate's signal axis; unused by the symmetric signal).

    Attributes
    ----------
    s_tilde : dict
        ``group index -> EligibilityTrace`` of the hidden factors.
    theta_tilde : dict
        ``(group index, parameter path) -> EligibilityTrace`` of the parameter factors.
    projection_rng : brainstate.ShortTermState
        The carried PRNG key.
    projection_step : brainstate.ShortTermState
        The carried ``int32`` step counter.

    Raises
    ------
    TypeError
        For a ``projection_key`` that is neither an integer nor a key, or a non-numeric
        ``projection_eps``.
    ValueError
        For a ``projection_eps`` that is not positive or underflows to zero in float32.
    NotImplementedError
        At compile time, for a model whose hidden groups sit inside a descended scan or whose
        transition runs a ``while_loop``.

    Examples
    --------
    >>> import brainstate, jax.numpy as jnp, braintrace
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.RandomProjectionVjpAlgorithm,
    ...                              jnp.ones(3), projection_key=0)
    >>> out = learner(braintrace.MultiStepData(jnp.ones((5, 3))))  # five steps, one call
    >>> int(learner.projection_step.value), int(learner.running_index.value)
    (5, 1)
    >>> theta, = learner.get_etrace_of(learner.param_states[('W', 'weight')]).values()
    >>> theta['weight'].shape, theta['bias'].shape  # parameter-shaped: no hidden axis
    ((7, 4), (4,))
    """

    def __init__(
        self,
        model: brainstate.nn.Module,
        name: str | None = None,
        vjp_method: str = "multi-step",
        fast_solve: bool = True,
        control_flow: ControlFlowPolicy | None = None,
        config: ETraceConfig | None = None,
        projection_key: int | jax.Array = 42,
        projection_eps: float = 1e-12,
        random_feedback_key: int | jax.Array | None = None,
    ) -> None:
        data = key_data(projection_key, "projection_key")
        eps = checked_eps(projection_eps, "projection_eps")
        super().__init__(model, name=name, vjp_method=vjp_method, control_flow=control_flow, config=config)
        self.vjp_executor.transition_points = True
        self.vjp_executor.include_weight_to_weight = True
        self.projection_key = projection_key
        self.projection_eps = eps
        self._key_data = data
        self.fast_solve = bool(fast_solve)
        self.random_feedback_key = random_feedback_key
        self.s_tilde: TraceStore[int] = CarrierStore()
        self.theta_tilde: TraceStore[FactorKey] = CarrierStore()
        self.projection_rng = brainstate.ShortTermState(jnp.asarray(self._key_data))
        self.projection_step = brainstate.ShortTermState(jnp.zeros((), jnp.int32))
        self._group_paths: dict[int, list[Path]] = {}
        self._group_relations: dict[int, list[HiddenParamOpRelation]] = {}
        self._param_treedefs: dict[Path, jax.tree_util.PyTreeDef] = {}

    @staticmethod
    def _check_config(config: ETraceConfig | None) -> ETraceConfig:
        # ETraceConfig itself allows random_projection only with the coupled scope, the jacobian
        # recursion and no filter; this engine realises the symmetric learning signal.
        if config is None:
            config = ETraceConfig(trace_factorization="random_projection", recurrence_scope="coupled")
        return engine_config(config, "random_projection", "RandomProjectionVjpAlgorithm", ("symmetric",))

    # --- trace storage --------------------------------------------------------------------

    def init_etrace_state(self, *args: PyTree, **kwargs: object) -> None:
        """Allocate zero factors (``s̃`` per group, ``θ̃`` per group and parameter), the key and counter."""
        graph = self.graph
        for group in graph.hidden_groups:
            if contains_eqn(group.transition_jaxpr, lambda e: e.primitive.name == "while"):
                raise NotImplementedError(
                    f"{type(self).__name__}: the transition of hidden group {group.index} "
                    f"({group.hidden_paths}) runs a while_loop, which reverse mode cannot cross to "
                    f"reach the factors' learning signal ∂L/∂h. Use D_RTRL, or write the loop with a "
                    f"fixed trip count (lax.fori_loop with static bounds, or lax.scan)."
                )
        group_paths: dict[int, list[Path]] = {}
        group_relations: dict[int, list[HiddenParamOpRelation]] = {}
        for rel in graph.hidden_param_op_relations:
            credited = self._credited_paths(rel)
            for group in rel.hidden_groups:
                group_relations.setdefault(group.index, []).append(rel)
                paths = group_paths.setdefault(group.index, [])
                paths.extend(p for p in credited if p not in paths)
        self._group_paths = dict(sorted(group_paths.items()))
        self._group_relations = group_relations
        params = self.param_states
        self._param_treedefs = {p: jax.tree.structure(params[p].value) for ps in group_paths.values() for p in ps}
        s_tilde: dict[int, jax.Array] = {}
        for gi in self._group_paths:
            group = graph.hidden_groups[gi]
            shape = jax.eval_shape(lambda g=group: g.concat_hidden(
                [jnp.zeros(v.aval.shape, v.aval.dtype) for v in g.hidden_invars]))
            s_tilde[gi] = jnp.zeros(shape.shape, shape.dtype)
        self.s_tilde = CarrierStore.of_zeros(s_tilde, EligibilityTrace)
        self.theta_tilde = CarrierStore.of_zeros({
            (gi, p): jax.tree.map(jnp.zeros_like, _mantissas(params[p].value))
            for gi, paths in self._group_paths.items() for p in paths
        }, EligibilityTrace)
        self.projection_rng.value = jnp.asarray(self._key_data)
        self.projection_step.value = jnp.zeros((), jnp.int32)

    def _credited_paths(self, rel: HiddenParamOpRelation) -> list[Path]:
        """The parameters a relation's operands are computed from (through operand chains)."""
        paths: list[Path] = []
        for key, path in rel.trainable_paths.items():
            chain = self._operand_chains.get(id(rel.trainable_vars[key]))
            found = [p for p, _ in chain.leaves] if chain is not None else [path]
            paths.extend(p for p in found if p not in paths)
        return paths

    def _get_etrace_data(self) -> ProjectionCarrier:
        return ProjectionCarrier(
            s_tilde=self.s_tilde.read(),
            theta_tilde=self.theta_tilde.read(),
            key=self.projection_rng.value,
            step=self.projection_step.value,
        )

    def _assign_etrace_data(self, etrace_vals: ProjectionCarrier) -> None:
        self.s_tilde.assign(etrace_vals["s_tilde"])
        self.theta_tilde.assign(etrace_vals["theta_tilde"])
        self.projection_rng.value = etrace_vals["key"]
        self.projection_step.value = etrace_vals["step"]

    def reset_state(self, batch_size: int | None = None, **kwargs: object) -> None:
        """Zero the factors, the step counter and ``running_index``; re-derive the key.

        A run after a reset repeats the run after the previous one bit for bit. With
        ``batch_size``, on a learner compiled with a batch (:attr:`batch_size` set), each ``s̃``
        gets that leading size; an unbatched learner's ``s̃`` has no batch axis and keeps its
        shape. ``θ̃`` is parameter-shaped and keeps its shape.
        """
        batched = self.batch_size is not None
        self.s_tilde.reset(batch_size, lambda group_index: batched)
        self.theta_tilde.reset()
        self.running_index.value = jnp.zeros_like(self.running_index.value)
        self.projection_step.value = jnp.zeros((), jnp.int32)
        self.projection_rng.value = jnp.asarray(self._key_data)

    def get_etrace_of(self, weight: brainstate.ParamState | Path) -> dict[FactorKey, PyTree]:
        """The parameter factors ``θ̃`` of ``weight`` (a ``ParamState`` or its path), one per group.

        Returns
        -------
        dict
            ``{(group index, path): θ̃}``, each ``θ̃`` shaped (and unit-carrying) like the parameter.

        Raises
        ------
        ValueError
            If no relation learns ``weight``.
        """
        path = weight if isinstance(weight, tuple) else self.state_id_to_path.get(id(weight))
        found = self.theta_tilde.select((k for k in self.theta_tilde if k[1] == path),
                                        lambda key, mantissas: self._with_unit(key[1], mantissas))
        if not found:
            shown = f"a {type(weight).__name__} that is not a state of this model" if path is None else path
            raise ValueError(
                f"get_etrace_of: there is no etrace of the given weight ({shown}). Only the weights "
                f"of compiled relations (ETP operations that drive hidden states) have factors; "
                f"learner.report lists them."
            )
        return found

    def _relation_etrace(self, rel: HiddenParamOpRelation, group: HiddenGroup) -> RelationFactors:
        paths = self._credited_paths(rel)
        return RelationFactors(
            s_tilde=self.s_tilde[group.index].value,
            theta_tilde={p: self._with_unit(p, self.theta_tilde[(group.index, p)].value) for p in paths},
        )

    def _with_unit(self, path: Path, mantissas: PyTree) -> PyTree:
        return jax.tree.unflatten(self._param_treedefs[path], jax.tree.leaves(mantissas))

    # --- one step of the carrier ----------------------------------------------------------

    def _draw_projection(self, key: jax.Array, step: jax.Array, group_index: int, shape: tuple[int, ...],
                         dtype: jax.typing.DTypeLike) -> jax.Array:
        """The draw ``ν`` of one group at one step: Rademacher entries (±1) of ``shape``.

        A pure function of its arguments (``key`` is the group's subkey of the step); override
        it to inject draws, e.g. from a table indexed by ``step``.
        """
        return rademacher_draw(key, shape, dtype)

    def _roll(
        self, carrier: ProjectionCarrier, xs: dict[int, jax.Array], dfs: ProjectionTails,
        points: Sequence[TransitionPoint], weight_vals: dict[Path, PyTree],
    ) -> ProjectionCarrier:
        """One step of every group's factors (see the module docstring)."""
        groups = self.graph.hidden_groups
        keys = jax.random.split(carrier["key"], len(groups) + 1)
        step = carrier["step"]
        s_new: dict[int, jax.Array] = {}
        theta_new: dict[FactorKey, PyTree] = {}
        for gi, paths in self._group_paths.items():
            s_old = carrier["s_tilde"][gi]
            nu = self._draw_projection(keys[gi + 1], step, gi, tuple(s_old.shape), s_old.dtype)
            proj = self._group_projection(groups[gi], nu, xs, dfs, weight_vals)
            ds = transition_jvp(groups[gi], points[gi], s_old)
            theta_old = {p: carrier["theta_tilde"][(gi, p)] for p in paths}
            s_new[gi], theta_g = projection_update(s_old, theta_old, nu, proj, ds, self.projection_eps)
            theta_new.update({(gi, p): v for p, v in theta_g.items()})
        return ProjectionCarrier(s_tilde=s_new, theta_tilde=theta_new, key=keys[0], step=step + 1)

    def _group_projection(
        self, group: HiddenGroup, nu: jax.Array, xs: dict[int, jax.Array], dfs: ProjectionTails,
        weight_vals: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        """``νᵀ J_f`` for every parameter of the group's relations (parameter-shaped mantissas).

        Each relation projects by its primitive's ``xy_to_dw`` rule at the tail's cotangent
        ``νᵀ ∂h/∂y``; operands computed from parameters are pulled back to them, and a weight
        read by several relations of the group sums their projections.
        """
        grads = {p: jax.tree.map(jnp.zeros_like, _mantissas(weight_vals[p])) for p in self._group_paths[group.index]}
        for rel in self._group_relations[group.index]:
            x = None if rel.x_var is None else xs[id(rel.x_var)]
            weights = self._relation_operands(rel, weight_vals)
            point = dfs[df_key(rel, group)]
            if not isinstance(point, TailPoint):
                raise internal_error(f"the tail of {rel.primitive.name} under control flow reached a random projection")
            per_key = relation_projection(rel, group, nu, x, point, weights)
            for k, g in per_key.items():
                grads = self._add_operand_gradient(grads, rel, k, g, weight_vals)
        return grads

    def _update_etrace_data(
        self, running_index: jax.Array, etrace_vals_util_t_1: ProjectionCarrier,
        hid2weight_jac_single_or_multi_times: CallWeightJacobians,
        hid2hid_jac_single_or_multi_times: CallHiddenJacobians, weight_vals: dict[Path, PyTree],
        input_is_multi_step: bool,
    ) -> ProjectionCarrier:
        xs, dfs = hid2weight_jac_single_or_multi_times
        points = hid2hid_jac_single_or_multi_times
        if not _holds_points(points):
            raise internal_error(f"{type(self).__name__} received hidden Jacobians, though its executor sets "
                                 f"transition_points")
        if not input_is_multi_step:
            return self._roll(etrace_vals_util_t_1, xs, dfs, points, weight_vals)
        stepper = self._make_etrace_stepper(weight_vals)
        rolled: ProjectionCarrier = jax.lax.scan(stepper, etrace_vals_util_t_1, (xs, dfs, points))[0]
        return rolled

    def _make_etrace_stepper(self, weight_vals: dict[Path, PyTree]) -> ProjectionStepper:
        # Always fused into the executor's scan: a window never stacks per-step values.
        def stepper(carry: ProjectionCarrier, jac: ProjectionStep) -> tuple[ProjectionCarrier, None]:
            xs, dfs, points = jac
            return self._roll(carry, xs, dfs, points, weight_vals), None

        return stepper

    # --- the gradient ---------------------------------------------------------------------

    def _trace_for_backward(
        self, old_etrace: ProjectionCarrier, new_etrace: ProjectionCarrier, jac: CallJacobians | None,
        single_step: bool,
    ) -> BoundaryTerm:
        return BoundaryTerm(old_etrace)

    def _with_previous_signal(self, trace_for_bwd: BoundaryTerm, previous: list[jax.Array]) -> BoundaryTerm:
        # Single step: the factors entering the step describe h^{t-1}; they meet the step loss's
        # ∂L/∂h^{t-1} through every path of the step (the window rule for a one-step window).
        return BoundaryTerm(*trace_for_bwd)._replace(previous=previous)

    def _solve_weight_gradients(
        self, running_index: jax.Array, etrace_h2w_at_t: BoundaryTerm, dl_to_hidden_groups: Sequence[jax.Array],
        weight_vals: dict[Path, PyTree], dl_to_nonetws_at_t: dict[Path, PyTree], dl_to_etws_at_t: dict[Path, PyTree],
    ) -> dict[Path, PyTree]:
        carrier, previous = BoundaryTerm(*etrace_h2w_at_t)
        signals = dl_to_hidden_groups if previous is None else previous
        grads = dict(dl_to_etws_at_t)
        for gi, paths in self._group_paths.items():
            s = carrier["s_tilde"][gi]
            acc = jnp.promote_types(s.dtype, jnp.float32)
            scale = jnp.sum(jnp.asarray(signals[gi]).astype(acc) * s.astype(acc))
            for p in paths:
                grads[p] = self._add_scaled(p, grads.get(p), carrier["theta_tilde"][(gi, p)], scale)
        return grads

    def _add_scaled(self, path: Path, tree: PyTree | None, theta: PyTree, scale: jax.Array) -> PyTree:
        """``tree + scale · θ̃`` leaf by leaf (``tree`` keeps its structure and units; ``None`` is zero)."""
        if tree is None:
            tree = self._with_unit(path, jax.tree.map(jnp.zeros_like, theta))
        leaves, treedef = jax.tree.flatten(tree)
        added = [g + (scale * t).astype(g.dtype) for g, t in zip(leaves, jax.tree.leaves(theta))]
        return jax.tree.unflatten(treedef, added)


RandomProjectionVjpAlgorithm.__module__ = "braintrace"


def _holds_points(Ds: CallHiddenJacobians) -> TypeGuard[list[TransitionPoint]]:
    """Whether the call's per-group slots hold :class:`TransitionPoint` (not Jacobians)."""
    return all(isinstance(D, TransitionPoint) for D in Ds)


def _mantissas(tree: PyTree) -> PyTree:
    """``tree`` with every ``brainunit`` quantity replaced by its mantissa."""
    return jax.tree.map(u.get_mantissa, tree, is_leaf=lambda x: isinstance(x, u.Quantity))
