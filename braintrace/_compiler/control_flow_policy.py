"""``ControlFlowPolicy``: how the compiler treats cond, scan and while inside a model step.

Examples
--------
>>> import braintrace
>>> braintrace.ControlFlowPolicy(cond='opaque').scan_unroll_limit
16
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ControlFlowPolicy", "DEFAULT_CONTROL_FLOW_POLICY", "resolve_policy"]

_CHOICES = {
    "cond": ("convert", "opaque"),
    "while_hidden": ("opaque-fwd", "error"),
    "etp_in_control_flow": ("error", "exclude"),
    "scan_descent": ("auto", "off"),
}


@dataclass(frozen=True)
class ControlFlowPolicy:
    """Options for control flow inside the model step.

    Parameters
    ----------
    cond : {'convert', 'opaque'}
        ``'convert'`` rewrites a relevant ``lax.cond`` into its inlined branches followed by
        ``select_n`` so that ETP operations inside branches learn online; ``'opaque'`` keeps
        conds as they are.
    scan_unroll_limit : int
        Relevant inner scans (``for_loop``) up to this static length are unrolled; ``<= 0``
        disables unrolling.
    while_hidden : {'opaque-fwd', 'error'}
        A weight-free ``while_loop`` that updates a hidden state is kept as an opaque forward
        node (``'opaque-fwd'``), or rejected (``'error'``).
    etp_in_control_flow : {'error', 'exclude'}
        What to do with an ETP operation left inside a control-flow body the compiler could not
        flatten: raise, or warn and leave its weight out of online learning.
    scan_descent : {'auto', 'off'}
        Whether relevant scans longer than ``scan_unroll_limit`` are descended (one scan
        equation kept, per-substep values stacked) instead of rejected.
    fixpoint_iteration_limit : int
        The most rewriting sweeps cond conversion and scan unrolling may take together (each
        sweep can expose more work: a cond inside an unrolled scan, a scan inside a converted
        branch); a positive ``int``, default 64. A compile that still has a cond or scan to
        rewrite after that many sweeps raises :class:`braintrace.CompilationError` naming them.

    Raises
    ------
    ValueError
        On construction, for any value outside the choices above, or a
        ``fixpoint_iteration_limit`` that is not a positive ``int`` (``True`` included).

    Examples
    --------
    >>> import jax.numpy as jnp, braintrace
    >>> policy = braintrace.ControlFlowPolicy(scan_unroll_limit=4, etp_in_control_flow='exclude')
    >>> policy.cond, policy.scan_unroll_limit
    ('convert', 4)
    >>> learner = braintrace.compile(braintrace.nn.ValinaRNNCell(3, 4), braintrace.D_RTRL, jnp.ones(3),
    ...                              control_flow=policy)
    >>> braintrace.ControlFlowPolicy(cond='inline')
    Traceback (most recent call last):
        ...
    ValueError: ControlFlowPolicy.cond must be 'convert' or 'opaque', got 'inline'.
    >>> braintrace.ControlFlowPolicy().fixpoint_iteration_limit
    64
    >>> braintrace.ControlFlowPolicy(fixpoint_iteration_limit=0)
    Traceback (most recent call last):
        ...
    ValueError: ControlFlowPolicy.fixpoint_iteration_limit must be a positive int, got 0; ...
    """

    cond: str = "convert"
    scan_unroll_limit: int = 16
    while_hidden: str = "opaque-fwd"
    etp_in_control_flow: str = "error"
    scan_descent: str = "auto"
    fixpoint_iteration_limit: int = 64

    def __post_init__(self) -> None:
        for field, choices in _CHOICES.items():
            value = getattr(self, field)
            if value not in choices:
                options = " or ".join(repr(c) for c in choices)
                raise ValueError(f"ControlFlowPolicy.{field} must be {options}, got {value!r}.")
        if not isinstance(self.scan_unroll_limit, int) or isinstance(self.scan_unroll_limit, bool):
            raise ValueError(
                f"ControlFlowPolicy.scan_unroll_limit must be an int, got {self.scan_unroll_limit!r}."
            )
        _check_iteration_limit(self.fixpoint_iteration_limit)


def _check_iteration_limit(limit: object) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(
            f"ControlFlowPolicy.fixpoint_iteration_limit must be a positive int, got {limit!r}; "
            f"pass a whole number of rewriting sweeps such as 64 (the default)."
        )


ControlFlowPolicy.__module__ = "braintrace"

DEFAULT_CONTROL_FLOW_POLICY = ControlFlowPolicy()


def resolve_policy(policy: ControlFlowPolicy | None) -> ControlFlowPolicy:
    """``policy``, or the default when ``None``; a clear ``TypeError`` for anything else."""
    if policy is None:
        return DEFAULT_CONTROL_FLOW_POLICY
    if not isinstance(policy, ControlFlowPolicy):
        raise TypeError(
            f"control_flow must be a braintrace.ControlFlowPolicy or None, got {type(policy).__name__}."
        )
    return policy
