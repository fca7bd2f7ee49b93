"""Connectome-scale workload: a recurrent LIF network the size of the fly brain, learned online.

``python -m benchmarks.connectome [--neurons 139255] [--synapses 3000000] [--steps 20] [--batch 1]``

The network has ``--neurons`` LIF neurons wired by a synthetic connectome: about
``--synapses`` directed connections with heavy-tailed (lognormal) out- and in-degrees, generated
from a fixed seed with vectorised NumPy (nothing is downloaded). The connections are one
``brainevent.CSR`` matrix whose per-connection values are trainable through
:func:`braintrace.sparse_matmul`; a few hundred neurons feed a linear readout.

It measures, in one run:

* the per-step time of the forward pass alone (a jitted loop over ``T`` steps, no gradient),
  and of one-step ``pp_prop`` and ``D_RTRL`` learning (``learner.etrace_grad`` over the same
  ``T`` steps): the median of interleaved repeats, and each learner's ratio to the forward step;
* the compiled memory (XLA's memory analysis of the jitted step) of each learner at two
  sequence lengths, ``--long-steps`` and ``--longest-steps`` (default 1,000 and 10,000): flat
  in ``T`` for an online learner;
* the compiled memory of BPTT (``jax.grad`` through the time loop) at two short lengths, its
  growth per step, and from it the longest ``T`` whose BPTT step fits in ``--memory-gb``
  (default 24). BPTT is only compiled, never run, at these sizes.

It also says which kernels ``brainevent`` ran for the sparse products: ``numba`` when numba is
installed (``pip install braintrace[bench]``), else its pure-JAX kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
import warnings
from typing import Any, Callable

import brainevent
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

import braintrace
from benchmarks.__main__ import time_steps
from benchmarks.models import spike

#: The neurons of the whole-brain fly connectome this workload is sized after.
FLY_NEURONS = 139_255
FLY_SYNAPSES = 3_000_000
METHODS = ("forward", "pp_prop", "D_RTRL")
#: The smoke-run sizes ``python -m benchmarks --quick --connectome`` uses.
QUICK_ARGS = ["--neurons", "500", "--synapses", "5000", "--steps", "5", "--long-steps", "20",
              "--longest-steps", "200", "--repeats", "1"]


def generate_connectome(
    n_neurons: int, n_synapses: int, seed: int = 0, sigma: float = 1.2
) -> tuple[np.ndarray, np.ndarray]:
    """A directed graph with heavy-tailed degrees, as CSR ``(indptr, indices)`` over pre-synaptic rows.

    Each neuron's out-degree and in-degree propensity are lognormal with shape ``sigma``; each
    neuron's connections go to targets drawn in proportion to their in-degree propensity. Self
    connections and repeated pairs are dropped, so the graph has somewhat fewer than
    ``n_synapses`` connections; within a row the targets are sorted.

    Parameters
    ----------
    n_neurons : int
        Number of neurons, at least 2.
    n_synapses : int
        Number of connections drawn before duplicates are removed, at least 1.
    seed : int
        Seed of the NumPy generator: the same arguments give the same graph.
    sigma : float
        Shape of the lognormal degree distributions (larger: heavier tails).

    Returns
    -------
    indptr : ndarray
        ``(n_neurons + 1,)`` int32 row offsets.
    indices : ndarray
        ``(nnz,)`` int32 post-synaptic neuron of each connection.
    """
    if n_neurons < 2 or n_synapses < 1:
        raise ValueError(
            f"generate_connectome: need n_neurons >= 2 and n_synapses >= 1, got n_neurons={n_neurons}, "
            f"n_synapses={n_synapses}."
        )
    rng = np.random.default_rng(seed)
    out_weight = rng.lognormal(0.0, sigma, n_neurons)
    out_degree = np.minimum(np.floor(out_weight * n_synapses / out_weight.sum() + rng.random(n_neurons)),
                            n_neurons - 1).astype(np.int64)
    in_weight = rng.lognormal(0.0, sigma, n_neurons)
    pre = np.repeat(np.arange(n_neurons, dtype=np.int64), out_degree)
    # An i.i.d. sample of targets: sorted uniforms make the lookup cache-friendly, the shuffle
    # restores independence from the (sorted) sources.
    post = np.searchsorted(np.cumsum(in_weight / in_weight.sum()), np.sort(rng.random(pre.size)), side="right")
    post = np.minimum(post, n_neurons - 1)
    rng.shuffle(post)
    keep = pre != post
    pairs = np.sort(pre[keep] * n_neurons + post[keep])  # by row, then column
    pairs = pairs[np.concatenate([[True], pairs[1:] != pairs[:-1]])]
    rows, cols = np.divmod(pairs, n_neurons)
    indptr = np.zeros(n_neurons + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n_neurons), out=indptr[1:])
    return indptr.astype(np.int32), cols.astype(np.int32)


class ConnectomeLIF(brainstate.nn.Module):
    """A recurrent LIF network on a sparse connectome, with a linear readout.

    Per step, from the membrane potential ``v`` (``(batch, neurons)``)::

        s      = spike(v - 1)                                   # surrogate-gradient spikes
        v_new  = leak · v · (1 - s) + s @ W(w_rec) + I(x)       # W: the CSR connectome
        out    = v_new[:, -n_readout:] @ w_out

    ``w_rec`` (one value per connection) and ``w_out`` are trainable; the input ``x``
    (``(batch, n_in)``) drives the first ``n_sensory`` neurons through fixed random weights.
    ``detach_spikes=True`` stops the gradient through the spikes (reset and recurrent input),
    which makes the hidden-to-hidden Jacobian diagonal and D-RTRL exact over any number of steps.
    """

    def __init__(
        self,
        indptr: np.ndarray,
        indices: np.ndarray,
        n_in: int = 16,
        n_sensory: int = 256,
        n_readout: int = 256,
        n_out: int = 8,
        leak: float = 0.9,
        detach_spikes: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        n_neurons = indptr.size - 1
        if not 0 < n_sensory <= n_neurons or not 0 < n_readout <= n_neurons:
            raise ValueError(
                f"ConnectomeLIF: n_sensory={n_sensory} and n_readout={n_readout} must lie in "
                f"[1, {n_neurons}] (the number of neurons)."
            )
        rng = np.random.default_rng(seed)
        nnz = indices.size
        self.n_neurons, self.n_in, self.n_sensory, self.n_readout = n_neurons, n_in, n_sensory, n_readout
        self.leak, self.detach_spikes = leak, detach_spikes
        mean_in = max(nnz / n_neurons, 1.0)
        self.csr = brainevent.CSR(
            (jnp.zeros(nnz, jnp.float32), jnp.asarray(indices), jnp.asarray(indptr)), shape=(n_neurons, n_neurons))
        self.w_rec = brainstate.ParamState(jnp.asarray(rng.standard_normal(nnz) * 1.5 / np.sqrt(mean_in),
                                                       dtype=jnp.result_type(float)))
        self.w_in = jnp.asarray(rng.standard_normal((n_in, n_sensory)) * 2 / np.sqrt(n_in),
                                dtype=jnp.result_type(float))
        self.w_out = brainstate.ParamState(jnp.asarray(rng.standard_normal((n_readout, n_out)) / np.sqrt(n_readout),
                                                       dtype=jnp.result_type(float)))

    def init_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        shape = (self.n_neurons,) if batch_size is None else (batch_size, self.n_neurons)
        self.v = brainstate.HiddenState(jnp.zeros(shape, jnp.result_type(float)))

    def reset_state(self, batch_size: int | None = None, **kwargs: Any) -> None:
        # In place: a compiled learner holds this very state object.
        self.v.value = jnp.zeros_like(self.v.value)

    def update(self, x: jax.Array) -> jax.Array:
        v = self.v.value
        s = spike(v - 1.0)
        if self.detach_spikes:
            s = jax.lax.stop_gradient(s)
        recurrent = braintrace.sparse_matmul(s, self.w_rec.value, sparse_mat=self.csr)
        sensory = x @ self.w_in
        pad = [(0, 0)] * (sensory.ndim - 1) + [(0, self.n_neurons - self.n_sensory)]
        self.v.value = self.leak * v * (1 - s) + recurrent + jnp.pad(sensory, pad)
        return self.v.value[..., -self.n_readout:] @ self.w_out.value


def kernel_backend() -> str:
    """The kernels that run the CSR products here, as ``braintrace.sparse_matmul`` picks them."""
    if jax.default_backend() != "cpu":
        return "gather and scatter-add over the host coordinates (XLA)"
    if importlib.util.find_spec("numba") is not None:
        return "numba"
    return "jax_raw (pure JAX; numba not installed)"


def _loss(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def _build_model(indptr: np.ndarray, indices: np.ndarray) -> ConnectomeLIF:
    return ConnectomeLIF(indptr, indices, n_sensory=min(256, indptr.size - 1), n_readout=min(256, indptr.size - 1))


def forward_step(model: ConnectomeLIF, batch: int) -> Callable[[jax.Array, jax.Array], Any]:
    """From reset states, the forward pass over the sequence and its mean loss; no gradient."""
    brainstate.nn.init_all_states(model, batch_size=batch)

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        brainstate.nn.reset_all_states(model)
        return _loss(brainstate.transform.for_loop(model, xs), ys)

    return step


def bptt_step(model: ConnectomeLIF, batch: int) -> Callable[[jax.Array, jax.Array], Any]:
    """From reset states, ``jax.grad`` of the sequence's mean loss through the time loop."""
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)

    def loss_fn(xs: jax.Array, ys: jax.Array) -> jax.Array:
        brainstate.nn.reset_all_states(model)
        return _loss(brainstate.transform.for_loop(model, xs), ys)

    return brainstate.transform.jit(brainstate.transform.grad(loss_fn, params))


def online_step(model: ConnectomeLIF, batch: int, algorithm: str, **options: Any) -> tuple[Any, Any]:
    """From reset states, the learner's one-step online gradient of the same loss (``etrace_grad``)."""
    example = jnp.zeros((batch, model.n_in))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(model, algorithm, example, batch_size=batch, **options)

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        learner.reset()
        return learner.etrace_grad(xs, ys, step_fn=lambda x, y: _loss(learner(x), y))

    return step, learner


def trace_values(learner: Any) -> int:
    """The number of values the learner's eligibility traces hold."""
    return sum(leaf.size for leaf in jax.tree.leaves(learner.named_etraces()))


def compiled_memories(step: Any, xs: jax.Array, ys: jax.Array) -> tuple[float, float]:
    """``(total, temporary)`` bytes of the compiled step, from XLA's memory analysis.

    Total: temporaries + arguments + outputs - aliases; temporary: what the step allocates
    beyond its inputs and outputs (the input sequence itself grows with ``T``).
    """
    stats = step.lower(xs, ys).compile().memory_analysis()
    total = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
    return float(total - stats.alias_size_in_bytes), float(stats.temp_size_in_bytes)


def compile_seconds(step: Any, xs: jax.Array, ys: jax.Array) -> float:
    """Seconds to trace, lower and compile ``step`` for ``(xs, ys)``."""
    start = time.perf_counter()
    step.lower(xs, ys).compile()
    return time.perf_counter() - start


def _data(steps: int, batch: int, n_in: int, n_out: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((steps, batch, n_in)), jnp.float32),
            jnp.asarray(rng.standard_normal((steps, batch, n_out)), jnp.float32))


def run(
    neurons: int = FLY_NEURONS,
    synapses: int = FLY_SYNAPSES,
    batch: int = 1,
    steps: int = 20,
    long_steps: int = 1_000,
    longest_steps: int = 10_000,
    bptt_steps: tuple[int, int] = (10, 20),
    repeats: int = 5,
    memory_gb: float = 24.0,
) -> dict[str, Any]:
    """Build the workload, time each method per step and read the compiled memories.

    Returns a dict with ``connectome`` (sizes, degree statistics, generation seconds),
    ``kernels``, per-method rows in ``methods`` (``seconds_per_step``, ``vs_forward``,
    ``compile_seconds``; for the
    learners also ``trace_values``, ``mem_long``, ``mem_longest``, ``mem_growth``) and ``bptt``
    (``mem_short``, ``mem_long``, ``bytes_per_step``, ``max_steps``).
    """
    start = time.perf_counter()
    indptr, indices = generate_connectome(neurons, synapses)
    gen_seconds = time.perf_counter() - start
    out_deg = np.diff(indptr)
    in_deg = np.bincount(indices, minlength=neurons)
    report: dict[str, Any] = {
        "connectome": {
            "neurons": neurons, "synapses": int(indices.size), "generate_seconds": gen_seconds,
            "out_degree_mean": float(out_deg.mean()), "out_degree_max": int(out_deg.max()),
            "in_degree_max": int(in_deg.max()),
        },
        "kernels": kernel_backend(),
        "batch": batch, "steps": steps,
    }
    model = _build_model(indptr, indices)
    n_out = model.w_out.value.shape[1]
    xs, ys = _data(steps, batch, model.n_in, n_out)
    steps_of: dict[str, Any] = {"forward": forward_step(model, batch)}
    rows: dict[str, dict[str, Any]] = {"forward": {}}
    for name, algorithm, options in (("pp_prop", "pp_prop", {"decay_or_rank": 0.9}), ("D_RTRL", "d_rtrl", {})):
        step, learner = online_step(_build_model(indptr, indices), batch, algorithm, **options)
        steps_of[name] = step
        rows[name] = {"trace_values": trace_values(learner)}
        for key, length in (("long", long_steps), ("longest", longest_steps)):
            rows[name][f"mem_{key}"], rows[name][f"temp_{key}"] = compiled_memories(
                step, *_data(length, batch, model.n_in, n_out))
        rows[name]["mem_growth"] = rows[name]["mem_longest"] / rows[name]["mem_long"]
        rows[name]["temp_growth"] = rows[name]["temp_longest"] / rows[name]["temp_long"]
    for name, step in steps_of.items():
        rows[name]["compile_seconds"] = compile_seconds(step, xs, ys)
    for name, seconds in time_steps(steps_of, xs, ys, repeats).items():
        rows[name]["seconds_per_step"] = seconds / steps
    for row in rows.values():
        row["vs_forward"] = row["seconds_per_step"] / rows["forward"]["seconds_per_step"]
    report["methods"] = rows

    bptt = bptt_step(_build_model(indptr, indices), batch)
    short, long = (compiled_memories(bptt, *_data(t, batch, model.n_in, n_out))[0] for t in bptt_steps)
    per_step = (long - short) / (bptt_steps[1] - bptt_steps[0])
    budget = memory_gb * 2**30
    report["bptt"] = {
        "steps": bptt_steps, "mem_short": short, "mem_long": long, "bytes_per_step": per_step,
        "max_steps": int((budget - (short - per_step * bptt_steps[0])) // per_step) if per_step > 0 else math.inf,
        "memory_gb": memory_gb,
    }
    return report


def print_report(report: dict[str, Any]) -> None:
    c = report["connectome"]
    print(f"connectome: {c['neurons']} neurons, {c['synapses']} synapses (generated in {c['generate_seconds']:.1f} s; "
          f"out-degree mean {c['out_degree_mean']:.1f}, max {c['out_degree_max']}; in-degree max {c['in_degree_max']})")
    print(f"device: {jax.devices()[0].device_kind}; sparse kernels: {report['kernels']}; "
          f"batch {report['batch']}, timed over T={report['steps']}")
    rows = report["methods"]
    long_label = "mem MiB T=long/T=longest"
    print(f"  {'method':<10}{'ms/step':>10}{'vs forward':>12}{'compile s':>11}{'trace values':>14}  {long_label}")
    for name, r in rows.items():
        mem = f"{r['mem_long'] / 2**20:.1f} / {r['mem_longest'] / 2**20:.1f} (x{r['mem_growth']:.3f})" \
            if "mem_long" in r else "-"
        trace = str(r.get("trace_values", "-"))
        print(f"  {name:<10}{1e3 * r['seconds_per_step']:10.2f}{r['vs_forward']:12.2f}{r['compile_seconds']:11.1f}"
              f"{trace:>14}  {mem}")
    b = report["bptt"]
    print(f"  BPTT compiled memory: {b['mem_short'] / 2**20:.1f} MiB at T={b['steps'][0]}, "
          f"{b['mem_long'] / 2**20:.1f} MiB at T={b['steps'][1]}: {b['bytes_per_step'] / 2**20:.2f} MiB per step; "
          f"longest T within {b['memory_gb']:g} GB: {b['max_steps']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Online learning on a connectome-scale LIF network.")
    parser.add_argument("--neurons", type=int, default=FLY_NEURONS)
    parser.add_argument("--synapses", type=int, default=FLY_SYNAPSES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="T of the timed runs")
    parser.add_argument("--long-steps", type=int, default=1_000)
    parser.add_argument("--longest-steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-gb", type=float, default=24.0)
    args = parser.parse_args(argv)
    report = run(args.neurons, args.synapses, args.batch, args.steps, args.long_steps, args.longest_steps,
                 repeats=args.repeats, memory_gb=args.memory_gb)
    print_report(report)
    return report


if __name__ == "__main__":
    main()
