"""Run the learner benchmarks: ``python -m benchmarks [--quick] [--models lif256 ...]``.

For each model and each method it times one jitted training step over a batch of sequences:
states reset, the gradient of the sequence's mean loss (``jax.grad`` through time for BPTT,
``learner.etrace_grad`` for the online learners), the same SGD update. It also reads XLA's
compiled temporary memory at two sequence lengths, and prints ratios measured in this run (first
the seconds ``import braintrace`` adds to ``import brainstate``, median of fresh interpreters):

* ``vs BPTT``: the method's step time over the BPTT step time;
* ``vs D_RTRL``: the step time over the D_RTRL single-step time;
* ``vs floor`` (the single-step learners that carry D_RTRL's trace): step time over its floor,
  the time of a call (:func:`call_seconds`: an empty program over the step's arguments, launched
  and waited for) plus the traces' memory traffic, ``2 x trace bytes x T / bandwidth``;
  ``vs traffic``: step time over that traffic alone (``EProp single`` has EProp's
  defaults, ``κ = 0`` as in
  upstream braintrace, and carries D_RTRL's one trace; with ``κ > 0`` EProp carries a second
  trace-sized array, the filter ``ē``, so twice D_RTRL's bytes; ``EProp random single`` is
  ``feedback='random'`` at ``κ = 0``, D_RTRL's one trace met by a random-feedback learning
  signal; ``OSTLRecurrent single`` rolls D_RTRL's one trace with ``D`` the per-position block
  of the whole transition, recurrent weights included, and ``SnAp(n=1) single``, the same
  coupled scope, the same trace), with the bandwidth of a jitted
  in-place ``a*x+b`` measured here;
* ``temp MiB``: the step's compiled temporary memory at T=100 (:func:`temporary_bytes`);
* ``mem T1000/T100``: compiled temporary memory at T=1000 over T=100;
* ``compile vs BPTT``: the wall time of tracing, lowering and compiling the step over BPTT's, each
  the fastest of three compilations at fresh lengths near T=1000 (after a first at T=100, so that
  JAX's first-use costs fall on neither; one compilation varies by about ±20 %);
* ``bf16/f32``: the single-step time with traces stored in bfloat16 (``trace_dtype``) over the
  float32-trace time (D_RTRL, pp_prop). ``python -m benchmarks.half_precision`` measures the
  gradient drift of that storage over a long stream.

On ``leaky64`` the row ``D_RTRL by hand`` is D_RTRL written by hand in plain JAX
(:mod:`benchmarks.hand_written`: one ``lax.scan``, no graph, no custom VJP; tested to compute the
learner's gradient), and a line gives ``D_RTRL single``'s step and compile time over its: how far
the library's step and compile sit above what a user could write for this one model.

OTTT and OTPE learn only fixed-leak dense layers, so they have their own models
(``lif256-fixed``, ``lif1024-fixed``: :class:`~benchmarks.models.FixedLeakLIF` at the LIF sizes),
each timed against BPTT and D_RTRL on that same model (:data:`OTTT_METHODS`; OTPE in mode
``'full'`` carries D_RTRL's trace, so it has a ``vs floor``).

Then the connectome-scale workload of :mod:`benchmarks.connectome` (``--no-connectome`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import brainstate
import jax
import jax.numpy as jnp

import braintrace
from benchmarks import hand_written
from benchmarks.models import GRU, LIF, ConvRNN, FixedLeakLIF, LeakyRNN, VanillaRNN


@dataclass(frozen=True)
class Setting:
    name: str
    model: type
    hidden: int
    n_in: int = 16
    n_out: int = 4
    #: The methods run on this model (``None``: :data:`METHODS`).
    methods: tuple[str, ...] | None = None
    #: Whether the model has a hand-written plain-JAX D_RTRL (:mod:`benchmarks.hand_written`),
    #: timed as the row ``D_RTRL by hand``.
    by_hand: bool = False


#: The rows of a fixed-leak model: OTTT and OTPE and what they are compared with on that model.
OTTT_METHODS = ("BPTT", "D_RTRL single", "OTTT single", "OTPE single")
SETTINGS = {
    "leaky64": Setting("leaky64", LeakyRNN, 64, by_hand=True),
    "leaky256": Setting("leaky256", LeakyRNN, 256),
    "vanilla256": Setting("vanilla256", VanillaRNN, 256),
    "gru64": Setting("gru64", GRU, 64),
    "gru256": Setting("gru256", GRU, 256),
    "lif256": Setting("lif256", LIF, 256),
    "lif1024": Setting("lif1024", LIF, 1024),
    "lif256-fixed": Setting("lif256-fixed", FixedLeakLIF, 256, methods=OTTT_METHODS),
    "lif1024-fixed": Setting("lif1024-fixed", FixedLeakLIF, 1024, methods=OTTT_METHODS),
    # 8x8 map, 8 hidden channels, 3x3 kernel on [x, h]: D_RTRL keeps one kernel per position.
    "conv8": Setting("conv8", ConvRNN, 8, n_in=64),
}
METHODS = ("BPTT", "D_RTRL single", "D_RTRL multi(10)", "pp_prop single", "pp_prop multi(10)",
           "EProp single", "EProp(κ=.9) single", "EProp random single", "OSTLRecurrent single",
           "SnAp(n=1) single", "D_RTRL single bf16", "pp_prop single bf16")
#: The rows with traces stored in bfloat16, and the float32-trace rows they are compared with.
BF16_OF = {"D_RTRL single bf16": "D_RTRL single", "pp_prop single bf16": "pp_prop single"}
#: The row of the hand-written plain-JAX D_RTRL (models with ``Setting.by_hand``).
BY_HAND = "D_RTRL by hand"
#: The rows every ratio is taken against, run whatever ``--methods`` selects.
REFERENCES = ("BPTT", "D_RTRL single")
#: How much shorter the sequences of the repeated compilations are (a multiple of every window).
COMPILE_STRIDE = 10
#: The trace-sized arrays each single-step method reads and writes once per step.
TRACES_PER_STEP = {"D_RTRL single": 1, "EProp single": 1, "EProp(κ=.9) single": 2, "EProp random single": 1,
                   "OSTLRecurrent single": 1, "SnAp(n=1) single": 1, "OTPE single": 1}


def _loss(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def _sgd(params: Mapping[Any, brainstate.ParamState], grads: Mapping[Any, Any]) -> Any:
    """The update every method applies: plain SGD in place; returns a leaf to block on."""
    for p, g in grads.items():
        params[p].value = jax.tree.map(lambda v, d: v - 1e-3 * d, params[p].value, g)
    return jax.tree.leaves(grads)[0]


def bptt_step(setting: Setting, batch: int) -> Callable[[jax.Array, jax.Array], Any]:
    """From reset states, ``jax.grad`` of the sequence's mean loss, then SGD."""
    model = setting.model(setting.n_in, setting.hidden, setting.n_out)
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)

    def loss_fn(xs: jax.Array, ys: jax.Array) -> jax.Array:
        brainstate.nn.reset_all_states(model)
        outs = brainstate.transform.for_loop(model, xs)
        return _loss(outs, ys)

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        return _sgd(params, brainstate.transform.grad(loss_fn, params)(xs, ys))

    return step


def hand_step(setting: Setting, batch: int) -> Callable[[jax.Array, jax.Array], Any]:
    """From zero states, the hand-written plain-JAX D_RTRL gradient of the same loss
    (:mod:`benchmarks.hand_written`, the leaky RNN only), then SGD."""
    model = setting.model(setting.n_in, setting.hidden, setting.n_out)
    return hand_written.leaky_d_rtrl_step(model, _loss, _sgd)


def online_step(setting: Setting, batch: int, algorithm: str, window: int, **options: Any) -> tuple[Any, Any]:
    """From reset states, the learner's online gradient of the same loss (``etrace_grad``), then SGD.

    ``window`` 1: one learner call per step (single-step); ``k``: one call per window of ``k``
    steps (multi-step).
    """
    model = setting.model(setting.n_in, setting.hidden, setting.n_out)
    vjp = "single-step" if window == 1 else "multi-step"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        learner = braintrace.compile(
            model, algorithm, jnp.zeros((batch, setting.n_in)), batch_size=batch, vjp_method=vjp, **options)

    def step_fn(x: jax.Array, y: jax.Array) -> jax.Array:
        if window == 1:
            return _loss(learner(x), y)
        return jnp.mean((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=(1, 2))  # one loss per step

    @brainstate.transform.jit
    def step(xs: jax.Array, ys: jax.Array) -> Any:
        learner.reset()
        return _sgd(learner.param_states, learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=window))

    return step, learner


def trace_bytes(learner: Any) -> int:
    traces = getattr(learner, "etrace_bwg", {})
    return sum(leaf.size * leaf.dtype.itemsize for st in traces.values() for leaf in jax.tree.leaves(st.value))


def time_steps(steps: dict[str, Any], xs: jax.Array, ys: jax.Array, repeats: int) -> dict[str, float]:
    """Median seconds per call of each step, the steps taking turns so that drifts in the
    machine's load reach every method alike, after two warm-up calls each (the second call of a
    step may still retrace)."""
    for step in steps.values():
        for _ in range(2):
            jax.block_until_ready(step(xs, ys))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(xs, ys))
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def call_seconds(step: Any, xs: jax.Array, ys: jax.Array, repeats: int) -> float:
    """Median seconds of an empty program called over ``step``'s arguments (its states' values and
    the sequences), launched and waited for as the step is: what any call of a compiled step costs
    on this device before its work. On a TPU v5e about 0.6 ms, a third of a 256-unit model's BPTT
    step; on a CPU tens of microseconds."""
    states = step.stateful_fun.get_state_trace(xs, ys, compile_if_miss=True).get_state_values()
    empty = jax.jit(lambda states, xs, ys: xs.reshape(-1)[0], keep_unused=True)
    for _ in range(2):
        jax.block_until_ready(empty(states, xs, ys))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(empty(states, xs, ys))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def compile_step(step: Any, xs: jax.Array, ys: jax.Array) -> tuple[float, float]:
    """XLA's compiled temporary bytes of ``step`` on ``(xs, ys)``, and the seconds that tracing,
    lowering and compiling it took."""
    start = time.perf_counter()
    compiled = step.lower(xs, ys).compile()
    seconds = time.perf_counter() - start
    try:
        return temporary_bytes(compiled.memory_analysis()), seconds
    except Exception:  # not every backend reports memory
        return float("nan"), seconds


def temporary_bytes(stats: Any) -> float:
    """The temporary bytes of a compiled program: XLA's ``temp_size_in_bytes``, or, where the
    backend reports none beside a peak (a TPU's runtime reads 0 for every program), what the peak
    holds beyond the program's arguments and outputs."""
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    if stats.temp_size_in_bytes or not peak:
        return float(stats.temp_size_in_bytes)
    outside = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return float(max(peak - outside, 0))


def bandwidth(n_bytes: int | None = None, repeats: int = 5, updates: int | None = None) -> float:
    """Bytes per second of ``updates`` in-place ``x ← a*x+b`` over ``n_bytes`` of float32 (read +
    write), in one jitted program.

    In place (the buffer donated), as a learner updates its trace inside the time loop: a fresh
    output buffer each call would time the operating system's page faults as well. The updates
    run in one loop whose trip count is an argument, so that XLA cannot merge them. On an
    accelerator, ten updates of 1 GiB per program, so that the launch of one program is spread
    over them (on a TPU v5e one update of 256 MiB per call reads 347 GB/s, ten over 1 GiB 636 GB/s
    of its 819 GB/s peak); on CPU one update of 256 MiB, the probe of the CPU figures.
    """
    on_cpu = jax.default_backend() == "cpu"
    n_bytes = n_bytes or (256 * 2**20 if on_cpu else 2**30)
    updates = updates or (1 if on_cpu else 10)
    f = jax.jit(lambda x, k: jax.lax.fori_loop(0, k, lambda _, v: 1.0001 * v + 0.5, x), donate_argnums=0)
    x = jax.block_until_ready(f(jnp.ones(n_bytes // 4, jnp.float32), updates))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(f(x, updates))
        samples.append(time.perf_counter() - start)
    return 2 * n_bytes * updates / statistics.median(samples)


def run(setting: Setting, batch: int, steps: int, long_steps: int, repeats: int, bw: float,
        compilations: int = 3, only: Sequence[str] | None = None) -> dict[str, Any]:
    """Every method's row on ``setting`` (or those of ``only``, with BPTT and D_RTRL single, the
    references of the ratios): its step timed ``repeats`` times, its compile time the fastest of
    ``compilations`` at fresh lengths near ``long_steps``."""
    key = jax.random.PRNGKey(0)
    data = lambda t: (jax.random.normal(key, (t, batch, setting.n_in)),  # noqa: E731
                      jax.random.normal(key, (t, batch, setting.n_out)))
    xs, ys = data(steps)
    xl, yl = data(long_steps)
    builders: dict[str, Callable[[], tuple[Any, Any]]] = {
        "BPTT": lambda: (bptt_step(setting, batch), None),
        "D_RTRL single": lambda: online_step(setting, batch, "d_rtrl", 1),
        "D_RTRL multi(10)": lambda: online_step(setting, batch, "d_rtrl", 10),
        "pp_prop single": lambda: online_step(setting, batch, "pp_prop", 1, decay_or_rank=0.9),
        "pp_prop multi(10)": lambda: online_step(setting, batch, "pp_prop", 10, decay_or_rank=0.9),
        "EProp single": lambda: online_step(setting, batch, "eprop", 1),
        "EProp(κ=.9) single": lambda: online_step(setting, batch, "eprop", 1, kappa_filter_decay=0.9),
        "EProp random single": lambda: online_step(setting, batch, "eprop", 1, feedback="random",
                                                   random_feedback_key=0),
        "OSTLRecurrent single": lambda: online_step(setting, batch, "ostl_recurrent", 1),
        "SnAp(n=1) single": lambda: online_step(setting, batch, "snap", 1, n=1),
        "D_RTRL single bf16": lambda: online_step(setting, batch, "d_rtrl", 1, trace_dtype=jnp.bfloat16),
        "pp_prop single bf16": lambda: online_step(setting, batch, "pp_prop", 1, decay_or_rank=0.9,
                                                   trace_dtype=jnp.bfloat16),
        "OTTT single": lambda: online_step(setting, batch, "ottt", 1, leak=FixedLeakLIF.leak),
        "OTPE single": lambda: online_step(setting, batch, "otpe", 1, leak=FixedLeakLIF.leak),
        BY_HAND: lambda: (hand_step(setting, batch), None),
    }
    methods = (METHODS if setting.methods is None else setting.methods) + ((BY_HAND,) if setting.by_hand else ())
    if only is not None:
        methods = tuple(m for m in methods if m in (*REFERENCES, *only))
    builders = {name: build for name, build in builders.items() if name in methods}
    rows: dict[str, Any] = {}
    steps_of: dict[str, Any] = {}
    for name, build in builders.items():
        step, learner = build()
        steps_of[name] = step
        mem_short, _ = compile_step(step, xs, ys)
        mem_long, compile_seconds = compile_step(step, xl, yl)
        for shorter in range(COMPILE_STRIDE, compilations * COMPILE_STRIDE, COMPILE_STRIDE):  # fresh: nothing cached
            compile_seconds = min(compile_seconds, compile_step(step, xl[shorter:], yl[shorter:])[1])
        rows[name] = {
            "mem_short": mem_short,
            "mem_long": mem_long,
            "compile_seconds": compile_seconds,
            "trace_bytes": trace_bytes(learner) if learner is not None else 0,
        }
    for name, seconds in time_steps(steps_of, xs, ys, repeats).items():
        rows[name]["seconds"] = seconds
    bptt, d_rtrl = rows["BPTT"]["seconds"], rows["D_RTRL single"]["seconds"]
    for name, r in rows.items():
        r["vs_bptt"] = r["seconds"] / bptt
        r["vs_d_rtrl"] = r["seconds"] / d_rtrl
        r["mem_growth"] = r["mem_long"] / r["mem_short"] if r["mem_short"] else float("nan")
        r["compile_vs_bptt"] = r["compile_seconds"] / rows["BPTT"]["compile_seconds"]
    for name, traces in TRACES_PER_STEP.items():
        if name not in rows:
            continue
        traffic = 2 * traces * rows["D_RTRL single"]["trace_bytes"] * steps / bw
        r = rows[name]
        r["call_seconds"] = call_seconds(steps_of[name], xs, ys, repeats)
        r["vs_floor"] = r["seconds"] / (r["call_seconds"] + traffic)
        r["vs_traffic"] = r["seconds"] / traffic if traffic else float("nan")
    for name, f32 in BF16_OF.items():
        if name not in rows:
            continue
        rows[name]["bf16_vs_f32"] = rows[name]["seconds"] / rows[f32]["seconds"]
    return rows


def import_seconds(repeats: int) -> dict[str, float]:
    """Median seconds, over ``repeats`` fresh interpreters, of ``import brainstate`` and of
    ``import braintrace`` after it (what braintrace adds to a brainstate program's start-up)."""
    code = ("import time; t0 = time.perf_counter(); import brainstate; t1 = time.perf_counter(); "
            "import braintrace; print(t1 - t0, time.perf_counter() - t1)")
    root = str(Path(__file__).resolve().parents[1])  # this checkout's braintrace, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            .stdout.split() for _ in range(repeats)]
    return {"brainstate": statistics.median(float(r[0]) for r in runs),
            "braintrace_over_brainstate": statistics.median(float(r[1]) for r in runs)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Online learners vs BPTT, as ratios measured in one run.")
    parser.add_argument("--models", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--methods", nargs="*", default=None,
                        choices=list(dict.fromkeys((*METHODS, *OTTT_METHODS, BY_HAND))),
                        help="only these rows of each model (BPTT and D_RTRL single, the references of the "
                             "ratios, always run)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--long-steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one compilation each, for a smoke run")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--connectome", action=argparse.BooleanOptionalAction, default=None,
                        help="the connectome-scale workload (benchmarks/connectome.py); default: on unless --quick")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.long_steps, args.repeats = 4, 20, 40, 1
        args.models = [m for m in args.models if not m.startswith("lif1024")]
    bw = bandwidth(16 * 2**20 if args.quick else None)
    print(f"device: {jax.devices()[0].device_kind}; in-place bandwidth {bw / 1e9:.1f} GB/s")
    interpreters = 1 if args.quick else 5
    imports = import_seconds(interpreters)
    print(f"import braintrace: {imports['braintrace_over_brainstate']:.2f} s over import brainstate "
          f"({imports['brainstate']:.2f} s; x{imports['braintrace_over_brainstate'] / imports['brainstate']:.2f}), "
          f"median of {interpreters} fresh interpreters")
    print(f"batch {args.batch}, T={args.steps} (memory also at T={args.long_steps})\n")
    results: dict[str, Any] = {"bandwidth_bytes_per_s": bw, "import_seconds": imports, "models": {}}
    for name in args.models:
        rows = run(SETTINGS[name], args.batch, args.steps, args.long_steps, args.repeats, bw,
                   compilations=1 if args.quick else 3, only=args.methods)
        results["models"][name] = rows
        print(f"{name}")
        print(f"  {'method':<20}{'vs BPTT':>9}{'vs D_RTRL':>11}{'vs floor':>10}{'vs traffic':>12}{'temp MiB':>10}"
              f"{'mem T' + str(args.long_steps) + '/T' + str(args.steps):>18}{'compile vs BPTT':>17}")
        for method, r in rows.items():
            floor, traffic = (f"{r[k]:.2f}" if k in r else "-" for k in ("vs_floor", "vs_traffic"))
            print(f"  {method:<20}{r['vs_bptt']:9.2f}{r['vs_d_rtrl']:11.2f}{floor:>10}{traffic:>12}"
                  f"{r['mem_short'] / 2**20:10.1f}{r['mem_growth']:18.2f}{r['compile_vs_bptt']:17.2f}")
        if "call_seconds" in rows["D_RTRL single"]:
            print(f"  a call (an empty program over D_RTRL single's arguments): "
                  f"{rows['D_RTRL single']['call_seconds'] * 1e3:.3f} ms")
        if BY_HAND in rows:
            d_rtrl, hand = rows["D_RTRL single"], rows[BY_HAND]
            print(f"  D_RTRL single over {BY_HAND}: step {d_rtrl['seconds'] / hand['seconds']:.2f}, "
                  f"compile {d_rtrl['compile_seconds'] / hand['compile_seconds']:.2f}")
        if any(n in rows for n in BF16_OF):
            print("  bf16/f32 trace: " + ", ".join(
                f"{f32} {rows[n]['bf16_vs_f32']:.2f}" for n, f32 in BF16_OF.items() if n in rows))
        print()
    if args.connectome if args.connectome is not None else not args.quick:
        from benchmarks import connectome  # it imports this module's timing helpers

        results["connectome"] = connectome.main(connectome.QUICK_ARGS if args.quick else [])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


if __name__ == "__main__":
    main()
