"""The seed tutorial's ``etp_scaled_mm`` rules at ``scale != 1``.

``xy_to_dw`` and the init rules are exact at any scale (the table rows check them). Its
``dt_to_t`` multiplies the propagated trace by ``scale``, but the ``y -> W`` link of the
recurrence ``D^t ε^{t-1}`` is ``hd`` alone: ``scale`` already sits in the instantaneous term.
Pinned here so that our own tutorial (which fixes the rule) and this finding stay in sync.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from braintrace._op import _registries as reg
from tests.op.cases.dense import dense_trace
from tests.op.cases.seed_scaled_mm import _scaled_matmul_impl, scaled_mm_p
from tests.op.opcase import rand, scale_y


def test_seed_dt_to_t_over_counts_the_scale() -> None:
    x, weights, hd = rand(1, (2, 3)), {"weight": rand(2, (3, 4))}, rand(3, (2, 4))
    params = dict(scale=2.0, has_bias=False)

    def fn(x, ws):  # type: ignore[no-untyped-def]
        return _scaled_matmul_impl(x, ws["weight"], **params)

    trace = dense_trace(fn, x, weights, params)
    exact = dense_trace(scale_y(fn, hd), x, weights, params)["weight"]
    seed = reg.ETP_RULES_DT_TO_T[scaled_mm_p](hd, trace, **params)["weight"]
    np.testing.assert_allclose(seed, 2.0 * exact, rtol=1e-6)
    np.testing.assert_allclose(trace["weight"] * jnp.expand_dims(hd, -2), exact, rtol=1e-6)
