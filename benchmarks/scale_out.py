"""Scaling a learner out over devices: ``python -m benchmarks.scale_out [--quick]``.

For 1, 2, 4 and 8 devices and each way of splitting (``data``: the batch over the devices;
``model``: the hidden units, their weights' outputs and their traces), it builds the same
D_RTRL learner with ``braintrace.compile(..., sharding=braintrace.Sharding(...))`` and reports:

* ``trace/device``: the eligibility-trace bytes on one device (read off the addressable shards),
  and that over the one-device figure (``1/devices`` is the ideal);
* ``XLA/device``: XLA's memory analysis of the compiled step on one device, its outputs (the
  new states and traces) plus its temporaries;
* ``time vs 1``: the median time of one jitted training step (states reset, ``etrace_grad`` over
  the sequence, SGD) over the one-device step time, the variants taking turns.

Without accelerators the devices are simulated on the CPU
(``--xla_force_host_platform_device_count=8``, set here when the backend is the CPU): they
share the same cores, so the time ratio shows the cost of the split program (collectives,
smaller kernels), not a speed-up; the memory columns are what a real device would hold. On CPU
a split batch also gives up the rules' CPU-only loop over batch rows (which would gather the
split trace onto every device) for one reduction, which XLA's CPU backend runs much slower.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import json
import warnings
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from benchmarks.__main__ import _loss, _sgd, time_steps
from benchmarks.models import LeakyRNN

DEVICES = (1, 2, 4, 8)
LAYOUTS = ("data", "model")


def sharding_for(layout: str, n: int) -> braintrace.Sharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), (layout,))
    return braintrace.Sharding(mesh, batch="data") if layout == "data" else braintrace.Sharding(mesh, hidden="model")


def sharded_step(layout: str, n: int, hidden: int, batch: int, n_in: int) -> tuple[Any, Any]:
    """The jitted training step of a D_RTRL learner split ``layout``-wise over ``n`` devices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(LeakyRNN(n_in, hidden, 4), "d_rtrl", jnp.zeros((batch, n_in)),
                                     batch_size=batch, sharding=sharding_for(layout, n))

    def step_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        return _loss(learner(x), y)

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        learner.reset()
        return _sgd(learner.param_states, learner.etrace_grad(xs, ys, step_fn=step_fn))

    return step, learner


def trace_bytes_per_device(learner: Any) -> int:
    """Bytes of every eligibility trace held by the first device of the mesh."""
    total = 0
    for st in learner.states(braintrace.EligibilityTrace).values():
        for leaf in jax.tree.leaves(st.value):
            first = leaf.sharding.mesh.devices.flat[0]
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == first)
    return total


def xla_bytes_per_device(step: Any, xs: jax.Array, ys: jax.Array) -> float:
    try:
        analysis = step.lower(xs, ys).compile().memory_analysis()
        return float(analysis.output_size_in_bytes + analysis.temp_size_in_bytes)
    except Exception:  # not every backend reports memory
        return float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Per-device memory and step time of a sharded learner.")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-in", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.batch, args.n_in, args.steps, args.repeats = 16, 8, 4, 4, 1
    devices = [n for n in DEVICES if n <= len(jax.devices())]
    key = jax.random.PRNGKey(0)
    xs = jax.random.normal(key, (args.steps, args.batch, args.n_in))
    ys = jax.random.normal(key, (args.steps, args.batch, 4))
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices; D_RTRL LeakyRNN, hidden {args.hidden}, "
          f"batch {args.batch}, T={args.steps}\n")
    results: dict[str, Any] = {}
    for layout in LAYOUTS:
        steps: dict[str, Any] = {}
        rows: dict[int, dict[str, Any]] = {}
        for n in devices:
            step, learner = sharded_step(layout, n, args.hidden, args.batch, args.n_in)
            steps[str(n)] = step
            rows[n] = {"trace_bytes_per_device": trace_bytes_per_device(learner),
                       "xla_bytes_per_device": xla_bytes_per_device(step, xs, ys)}
        for n_name, seconds in time_steps(steps, xs, ys, args.repeats).items():
            rows[int(n_name)]["seconds"] = seconds
        one = rows[devices[0]]
        print(f"split: {layout}")
        print(f"  {'devices':>7}{'trace/device':>14}{'vs 1':>7}{'XLA/device':>13}{'time vs 1':>11}")
        for n, r in rows.items():
            r["trace_vs_one"] = r["trace_bytes_per_device"] / one["trace_bytes_per_device"]
            r["time_vs_one"] = r["seconds"] / one["seconds"]
            print(f"  {n:>7}{r['trace_bytes_per_device']:>14,}{r['trace_vs_one']:7.3f}"
                  f"{r['xla_bytes_per_device']:>13,.0f}{r['time_vs_one']:11.2f}")
        print()
        results[layout] = rows
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


if __name__ == "__main__":
    main()
