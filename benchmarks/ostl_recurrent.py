"""OSTLRecurrent on a recurrent LIF network or a GRU: memory against BPTT, time against D_RTRL.

``python -m benchmarks.ostl_recurrent [--model lif|gru] [--hidden 256] [--batch 8] [--steps 100]``

One jitted training step over a batch of sequences (states reset per batch) for BPTT,
single-step D_RTRL, single-step OSTLRecurrent, and, for contrast, OSTLRecurrent with the
per-position Jacobian blocks read off the dense ``(P·S)²`` Jacobian (``P`` = batch × neurons)
as a naive implementation would. It prints, measured in this run:

* ``mem``: XLA's compiled memory of the step (temporaries + arguments + outputs − aliases),
  and the ratio to BPTT;
* ``time``: the median wall time of the step, and the ratio to D_RTRL.

The default model is :class:`benchmarks.models.LIF`: the recurrent spikes mix through a dense
ETP matmul on ``[x, spikes]``, which D_RTRL cuts from ``D`` and OSTLRecurrent keeps (its
diagonal). :class:`benchmarks.models.GRU` mixes twice in series (its reset gate reads ``h``
through one product before ``r h`` enters another), the second case of
:mod:`braintrace._compiler.mixing_jacobian`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from benchmarks.__main__ import SETTINGS, Setting, bptt_step, online_step, time_steps
from braintrace._compiler import hidden_group


def compiled_memory(step: Any, xs: jax.Array, ys: jax.Array) -> float:
    """Temporaries + arguments + outputs − aliased bytes of the compiled step."""
    stats = step.lower(xs, ys).compile().memory_analysis()
    return float(stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes)


def _dense_blocks(
    fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, forward: bool = False, mixing_axes: Any = None
) -> jax.Array:
    """The naive extraction: the dense Jacobian, then its per-position diagonal blocks (over
    every axis, whichever ``mixing_axes`` the fallback would probe)."""
    shape, num_state = hidden.shape[:-1], hidden.shape[-1]
    full = (jax.jacfwd if forward else jax.jacrev)(fn)(hidden)
    positions = math.prod(shape)
    full = full.reshape(positions, num_state, positions, num_state)
    idx = jnp.arange(positions)
    return full[idx, :, idx, :].reshape(*shape, num_state, num_state)


@contextlib.contextmanager
def dense_jacobian_blocks() -> Iterator[None]:
    """Route OSTLRecurrent's block extraction through the dense Jacobian (for the contrast row)."""
    saved_plan, saved_blocks = hidden_group.HiddenGroup._mixing_plan, hidden_group.block_diagonal_last_dim
    hidden_group.HiddenGroup._mixing_plan = lambda self: None  # type: ignore[method-assign]
    hidden_group.block_diagonal_last_dim = _dense_blocks  # type: ignore[assignment]
    try:
        yield
    finally:
        hidden_group.HiddenGroup._mixing_plan = saved_plan  # type: ignore[method-assign]
        hidden_group.block_diagonal_last_dim = saved_blocks


def measure(setting: Setting, batch: int, steps: int, repeats: int, with_dense: bool) -> dict[str, dict[str, float]]:
    key = jax.random.PRNGKey(0)
    xs = jax.random.normal(key, (steps, batch, setting.n_in))
    ys = jax.random.normal(key, (steps, batch, setting.n_out))
    builders: dict[str, Callable[[], Any]] = {
        "BPTT": lambda: bptt_step(setting, batch),
        "D_RTRL": lambda: online_step(setting, batch, "d_rtrl", 1)[0],
        "OSTLRecurrent": lambda: online_step(setting, batch, "ostl_recurrent", 1)[0],
    }
    step_fns = {name: build() for name, build in builders.items()}
    seconds = time_steps(step_fns, xs, ys, repeats)
    rows = {name: {"mem": compiled_memory(step, xs, ys), "seconds": seconds[name]} for name, step in step_fns.items()}
    if with_dense:
        with dense_jacobian_blocks():
            step = online_step(setting, batch, "ostl_recurrent", 1)[0]
            rows["OSTLRecurrent (dense Jacobian)"] = {"mem": compiled_memory(step, xs, ys), "seconds": float("nan")}
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description="OSTLRecurrent memory vs BPTT and time vs D_RTRL.")
    parser.add_argument("--model", choices=("lif", "gru"), default="lif")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense-Jacobian contrast row")
    args = parser.parse_args(argv)
    base = SETTINGS[f"{args.model}256"]
    setting = Setting(f"{args.model}{args.hidden}", base.model, args.hidden, base.n_in, base.n_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rows = measure(setting, args.batch, args.steps, args.repeats, not args.no_dense)
    print(f"device: {jax.devices()[0].device_kind}; {args.model.upper()} {args.hidden} units, batch {args.batch}, "
          f"T={args.steps}")
    print(f"  {'method':<32}{'mem MiB':>10}{'mem/BPTT':>10}{'time ms':>10}{'time/D_RTRL':>13}")
    for name, r in rows.items():
        r["mem_vs_bptt"] = r["mem"] / rows["BPTT"]["mem"]
        r["time_vs_drtrl"] = r["seconds"] / rows["D_RTRL"]["seconds"]
        print(f"  {name:<32}{r['mem'] / 2**20:10.2f}{r['mem_vs_bptt']:10.2f}{1e3 * r['seconds']:10.1f}"
              f"{r['time_vs_drtrl']:13.2f}")
    return rows


if __name__ == "__main__":
    main()
