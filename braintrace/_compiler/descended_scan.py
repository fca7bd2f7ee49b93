"""What a descended scan leaves on the graph: its description and the marks on the groups and
relations inside it.

:mod:`braintrace._compiler.scan_descent` builds these; the hidden groups and relations carry them
(``HiddenGroup.descent``, ``HiddenParamOpRelation.control_flow_context``), so they sit below both.

Examples
--------
>>> from braintrace._compiler.descended_scan import GroupDescent, RelationDescent
>>> GroupDescent._fields, RelationDescent._fields
(('scan', 'body_hidden_invars'), ('scan',))
"""

from __future__ import annotations

from typing import NamedTuple

from braintrace._compatible_imports import Jaxpr, Var

__all__ = ["ScanDescentInfo", "GroupDescent", "RelationDescent"]


class ScanDescentInfo(NamedTuple):
    """A descended scan: its shape and where each body value's per-substep stack lives.

    Attributes
    ----------
    length : int
        ``L``, the number of substeps.
    num_consts, num_carry : int
        The scan's parameters (unchanged by the rewrite).
    body_jaxpr : Jaxpr
        The rewritten scan body (the original body with extra stacked outputs).
    stacked_var_map : dict
        Body variable -> outer variable holding its values at every substep, ``(L, *shape)``.
    scan_eqn_id : int
        ``id`` of the rewritten scan equation in the compiled step.
    """

    length: int
    num_consts: int
    num_carry: int
    body_jaxpr: Jaxpr
    stacked_var_map: dict[Var, Var]
    scan_eqn_id: int


class GroupDescent(NamedTuple):
    """Marks a hidden group carried by a descended scan (its transition is body-scoped).

    Attributes
    ----------
    scan : ScanDescentInfo
    body_hidden_invars : list of Var
        The body's carry inputs of the members (the transition's invars).
    """

    scan: ScanDescentInfo
    body_hidden_invars: list[Var]


class RelationDescent(NamedTuple):
    """Marks a relation found inside a descended scan body (its variables are body-scoped)."""

    scan: ScanDescentInfo
