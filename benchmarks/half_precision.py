"""bfloat16 traces against float32 ones: gradient drift over a long stream.

``python -m benchmarks.half_precision [--model lif1024] [--batch 4] [--steps 1000]``

Two learners that differ only in ``trace_dtype`` (``None`` and ``jnp.bfloat16``) see the same
input stream from the same reset states, one single-step gradient per step and no parameter
update, so their hidden states stay identical and any difference is the stored trace's rounding.
For D_RTRL and pp_prop it prints, for the gradient of the traced weights:

* ``cos@t``: the cosine between the two learners' gradients at step ``t`` (per-step gradients
  read the trace at that step, so a drift of the bfloat16 trace shows up here first);
* ``cos sum``: the cosine between the gradients summed over the whole stream;
* ``rel sum``: ``|Σg_bf16 − Σg_f32| / |Σg_f32|``.

The step-time ratio of the two storages is part of ``python -m benchmarks`` (the rows
``D_RTRL single bf16`` and ``pp_prop single bf16``).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp

import braintrace
from benchmarks.__main__ import SETTINGS, Setting

#: The algorithms and options compared.
ALGORITHMS = {"D_RTRL": ("d_rtrl", {}), "pp_prop": ("pp_prop", {"decay_or_rank": 0.9})}


def _learner(setting: Setting, batch: int, algorithm: str, trace_dtype: Any, **options: Any) -> Any:
    model = setting.model(setting.n_in, setting.hidden, setting.n_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return braintrace.compile(model, algorithm, jnp.zeros((batch, setting.n_in)), batch_size=batch,
                                  trace_dtype=trace_dtype, **options)


def rounded_weights(learner: Any) -> list[Any]:
    """The paths of the weights whose traces ``learner`` stores in a 16-bit float (the weights
    whose gradients the storage can change)."""
    paths = {p for rel in learner.graph.hidden_param_op_relations for p in rel.trainable_paths.values()}
    return sorted(p for p in paths
                  if any(leaf.dtype.itemsize == 2 for leaf in jax.tree.leaves(learner.get_etrace_of(p))))


def _stream(learner: Any, paths: list[Any], xs: jax.Array, ys: jax.Array,
            checkpoints: tuple[int, ...]) -> tuple[Any, Any]:
    """The gradients of ``paths`` at ``checkpoints`` (0-based steps) and their sum over the
    stream, from reset states; one single-step gradient of the squared error per step."""
    params = learner.param_states

    def one(carry: Any, data: Any) -> tuple[Any, Any]:
        t, total, kept = carry
        x, y = data
        grads = brainstate.transform.grad(lambda: jnp.mean((learner(x) - y) ** 2), params)()
        flat = jnp.concatenate([g.ravel() for p in paths for g in jax.tree.leaves(grads[p])])
        kept = jnp.where(jnp.asarray(checkpoints)[:, None] == t, flat[None], kept)
        return (t + 1, total + flat, kept), None

    @brainstate.transform.jit
    def run() -> tuple[Any, Any]:
        learner.reset()
        size = sum(leaf.size for p in paths for leaf in jax.tree.leaves(params[p].value))
        start = (jnp.zeros((), jnp.int32), jnp.zeros(size), jnp.zeros((len(checkpoints), size)))
        (_, total, kept), _ = brainstate.transform.scan(one, start, (xs, ys))
        return total, kept

    return run()


def _cosine(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))


def drift(setting: Setting, batch: int, steps: int, algorithm: str, options: dict[str, Any]) -> dict[str, Any]:
    """Cosines of the bfloat16-trace gradient to the float32-trace gradient (see the module)."""
    key = jax.random.PRNGKey(1)
    xs = jax.random.normal(key, (steps, batch, setting.n_in))
    ys = jax.random.normal(jax.random.PRNGKey(2), (steps, batch, setting.n_out))
    checkpoints = tuple(sorted({min(t, steps) - 1 for t in (10, 100, steps)}))
    bf16 = _learner(setting, batch, algorithm, jnp.bfloat16, **options)
    paths = rounded_weights(bf16)
    f32_total, f32_kept = _stream(_learner(setting, batch, algorithm, None, **options), paths, xs, ys, checkpoints)
    bf16_total, bf16_kept = _stream(bf16, paths, xs, ys, checkpoints)
    row: dict[str, Any] = {"weights": paths}
    row.update({f"cos@{t + 1}": _cosine(f32_kept[i], bf16_kept[i]) for i, t in enumerate(checkpoints)})
    row["cos sum"] = _cosine(f32_total, bf16_total)
    row["rel sum"] = float(jnp.linalg.norm(bf16_total - f32_total) / jnp.linalg.norm(f32_total))
    return row


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description="Gradient drift of bfloat16 traces over a long stream.")
    parser.add_argument("--model", default="lif1024", choices=list(SETTINGS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args(argv)
    setting = SETTINGS[args.model]
    print(f"device: {jax.devices()[0].device_kind}; {args.model}, batch {args.batch}, T={args.steps}")
    rows = {}
    for name, (algorithm, options) in ALGORITHMS.items():
        rows[name] = row = drift(setting, args.batch, args.steps, algorithm, options)
        print(f"  {name:<10}" + "  ".join(f"{k} {v:.6f}" for k, v in row.items() if k != "weights")
              + f"  (weights {row['weights']})")
    return rows


if __name__ == "__main__":
    main()
