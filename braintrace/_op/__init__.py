"""The ETP operator layer: primitives the eligibility-trace compiler recognises.

This package owns ``register_primitive`` / ``ETPPrimitive``, the rule registries keyed by
primitive identity, and the user-facing operators (``matmul``, ``element_wise``, ...). It
knows nothing about algorithms: learners reach the operators only through the registries.
"""

from braintrace._op._primitive import ETPPrimitive, register_primitive
from braintrace._op._registries import (
    BATCHED_COUNTERPARTS,
    BATCHED_PRIMITIVES,
    ETP_FAST_PATH_RULES,
    ETP_PRIMITIVES,
    ETP_RULES_DT_TO_T,
    ETP_RULES_INIT_DRTRL,
    ETP_RULES_INIT_PP,
    ETP_RULES_INSTANT_DRTRL,
    ETP_RULES_PP_X_REPR,
    ETP_RULES_SNAP_ADJACENCY,
    ETP_RULES_SNAP_ANCHOR,
    ETP_RULES_SOLVE_DRTRL,
    ETP_RULES_XY_TO_DW,
    ETP_TRAINABLE_INVARS_FNS,
    ETP_X_INVAR_INDICES,
    ETP_Y_OUTVAR_INDICES,
    GRADIENT_ENABLED_PRIMITIVES,
    FastPathRules,
    freeze_library_rules,
    get_batched_counterpart,
    get_fast_path_rules,
    get_instant_drtrl_rule,
    get_pp_x_repr,
    get_snap_adjacency_rule,
    get_solve_drtrl_rule,
    get_trainable_invars,
    get_x_invar_index,
    get_y_outvar_index,
    is_batched_primitive,
    is_etp_enable_gradient_primitive,
    is_etp_primitive,
    is_snap_anchored,
    register_batched_counterpart,
)
from braintrace._op.conv import _etp_conv_impl, conv, etp_conv_p
from braintrace._op.dense import etp_mm_p, etp_mv_p, matmul
from braintrace._op.einsum import einsum, etp_einsum_p
from braintrace._op.elemwise import element_wise, etp_elemwise_p
from braintrace._op.embedding import embedding, etp_emb_p, etp_emb_v_p
from braintrace._op.grouped import etp_gmm_p, etp_gmv_p, grouped_matmul
from braintrace._op.lora import etp_lora_mm_p, etp_lora_mv_p, lora_matmul
from braintrace._op.sparse import etp_sp_mm_p, etp_sp_mv_p, sparse_matmul

# Every rule registered from here on is a user's (see has_library_rules).
freeze_library_rules()

__all__ = [
    "ETPPrimitive",
    "register_primitive",
    "ETP_PRIMITIVES",
    "ETP_RULES_DT_TO_T",
    "ETP_RULES_XY_TO_DW",
    "ETP_RULES_INIT_DRTRL",
    "ETP_RULES_INIT_PP",
    "ETP_TRAINABLE_INVARS_FNS",
    "ETP_X_INVAR_INDICES",
    "ETP_Y_OUTVAR_INDICES",
    "GRADIENT_ENABLED_PRIMITIVES",
    "BATCHED_PRIMITIVES",
    "is_etp_primitive",
    "is_etp_enable_gradient_primitive",
    "is_batched_primitive",
    "get_trainable_invars",
    "get_x_invar_index",
    "get_y_outvar_index",
    "BATCHED_COUNTERPARTS",
    "register_batched_counterpart",
    "get_batched_counterpart",
    "FastPathRules",
    "ETP_FAST_PATH_RULES",
    "get_fast_path_rules",
    "ETP_RULES_INSTANT_DRTRL",
    "ETP_RULES_SOLVE_DRTRL",
    "get_instant_drtrl_rule",
    "get_solve_drtrl_rule",
    "ETP_RULES_PP_X_REPR",
    "get_pp_x_repr",
    "ETP_RULES_SNAP_ANCHOR",
    "ETP_RULES_SNAP_ADJACENCY",
    "is_snap_anchored",
    "get_snap_adjacency_rule",
    "etp_mm_p",
    "etp_mv_p",
    "etp_gmm_p",
    "etp_gmv_p",
    "etp_emb_p",
    "etp_emb_v_p",
    "etp_einsum_p",
    "etp_elemwise_p",
    "etp_conv_p",
    "etp_sp_mm_p",
    "etp_sp_mv_p",
    "etp_lora_mm_p",
    "etp_lora_mv_p",
    "matmul",
    "grouped_matmul",
    "embedding",
    "einsum",
    "element_wise",
    "conv",
    "sparse_matmul",
    "lora_matmul",
]
