"""The sharded runs of ``tests/algorithm/test_sharding.py``, each in a process with several CPU devices.

``python -m tests.algorithm.sharding_script OUT GRID`` (``XLA_FLAGS`` asking for 8 host
devices) runs every case of ``GRID`` (``default``, ``exhaustive``, or ``rest``: the exhaustive
cases outside the default grid) twice: on one device,
and sharded over a mesh of the 8 (data parallel, model parallel, or both). It writes
``OUT/metrics.json`` (per case the largest relative difference of gradients, losses and final
states, the per-device trace bytes, the states' partition specs and any left off them; the
per-device trace bytes at 1, 2, 4 and 8 devices; XLA's per-device memory of a split step; the
errors of bad shardings; the placement after a reset) and ``OUT/reference.npz`` (the one-process run of the multi-host case on 4 devices).

:func:`multihost_run` is the multi-host run of that case (``tests/algorithm/sharding_worker.py``
starts it in each of two processes with 2 devices); process 0 writes ``OUT/multihost.npz``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any, Callable, NamedTuple
from unittest import mock

import brainstate
import braintools
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import braintrace
from braintrace._algorithm.engine import sharding as sharding_module
from tests.algorithm.test_snn_training import LIFNet

B, N_IN, H, T, WINDOW = 8, 5, 16, 4, 2


def rnn() -> brainstate.nn.Module:
    with brainstate.random.seed_context(0):
        return braintrace.nn.ValinaRNNCell(N_IN, H)


def lif() -> brainstate.nn.Module:
    return LIFNet(n_in=N_IN, n_hid=H)


class Case(NamedTuple):
    """A learner (model, algorithm, options) driven one way, on one mesh layout."""

    name: str
    model: Callable[[], brainstate.nn.Module]
    algorithm: str
    options: dict[str, Any]
    layout: str  # 'data', 'model' or 'both'
    drive: str = "grad"  # 'grad' (etrace_grad), 'window' (etrace_grad, chunk_size), 'train', 'vmap'


LEARNERS = [("rnn_d_rtrl", rnn, "d_rtrl", {}), ("rnn_pp_prop", rnn, "pp_prop", {"decay_or_rank": 0.9}),
            ("lif_es_d_rtrl", lif, "es_d_rtrl", {"decay_or_rank": 0.9})]


def cases(grid: str) -> list[Case]:
    """The cases of ``grid``: ``default`` (representative), ``exhaustive`` (every layout) or
    ``rest`` (the exhaustive cases outside the default grid)."""
    if grid == "rest":
        default = {case.name for case in cases("default")}
        return [case for case in cases("exhaustive") if case.name not in default]
    found = []
    for name, model, algorithm, options in LEARNERS:
        layouts = ("data", "model", "both") if grid == "exhaustive" or name == "rnn_d_rtrl" else ("both",)
        found += [Case(f"{name}/{layout}/grad", model, algorithm, options, layout) for layout in layouts]
        windowed = ("data", "model", "both") if grid == "exhaustive" else ("both",)
        found += [Case(f"{name}/{layout}/window", model, algorithm, options, layout, "window") for layout in windowed]
    drives = ("train", "vmap")
    layouts = ("data", "model", "both") if grid == "exhaustive" else ("both",)
    found += [Case(f"rnn_d_rtrl/{layout}/{d}", rnn, "d_rtrl", {}, layout, d) for d in drives for layout in layouts]
    return found


def mesh_for(layout: str, devices: list[Any]) -> braintrace.Sharding:
    n = len(devices)
    if layout == "data":
        return braintrace.Sharding(Mesh(np.array(devices), ("data",)), batch="data")
    if layout == "model":
        return braintrace.Sharding(Mesh(np.array(devices), ("model",)), hidden="model")
    return braintrace.Sharding(Mesh(np.array(devices).reshape(2, n // 2), ("data", "model")), batch="data", hidden="model")


def data(n_out: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    xs = rng.uniform(0.0, 1.5, (T, B, N_IN)).astype(np.float32)
    ys = rng.standard_normal((T, B, n_out)).astype(np.float32)
    return xs, ys


def build(case: Case, sharding: braintrace.Sharding | None) -> Any:
    options = dict(case.options)
    if case.drive == "window":
        options["vjp_method"] = "multi-step"
    return braintrace.compile(case.model(), case.algorithm, jnp.ones((B, N_IN)), batch_size=B, seed=0,
                              vmap=case.drive == "vmap", sharding=sharding, **options)


def run(case: Case, learner: Any, sharding: braintrace.Sharding | None) -> dict[str, np.ndarray]:
    """Drive ``learner`` over the sequence; every gradient, loss and final state, gathered to the host."""
    n_out = 2 if case.model is lif else H
    xs, ys = data(n_out)
    if sharding is not None:
        xs, ys = sharding.put((xs, ys), batch_axis=1)

    def step_fn(x: Any, y: Any) -> Any:
        if case.drive == "window":
            return jnp.mean((learner(braintrace.MultiStepData(x)) - y) ** 2, axis=(1, 2))
        return jnp.mean((learner(x) - y) ** 2)

    def go(xs: Any, ys: Any) -> Any:  # arguments, not closed over: a multi-host array cannot be a constant
        if case.drive == "train":
            result = learner.etrace_train(xs, ys, step_fn=step_fn, optimizer=braintools.optim.SGD(lr=0.1),
                                          update_every=2)
            return {}, result.losses
        return learner.etrace_grad(xs, ys, step_fn=step_fn, chunk_size=WINDOW if case.drive == "window" else None,
                                   return_value=True)

    grads, losses = brainstate.transform.jit(go)(xs, ys)
    out = {"loss": losses}
    for path, g in grads.items():
        for keys, leaf in jax.tree_util.tree_flatten_with_path(g)[0]:
            out[f"grad{path}{jax.tree_util.keystr(keys)}"] = leaf
    for path, value in final_states(learner).items():
        for keys, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
            out[f"state{path}{jax.tree_util.keystr(keys)}"] = leaf
    return {k: gathered(v) for k, v in out.items()}


def final_states(learner: Any) -> dict[Any, Any]:
    """Every model state and trace value, by a name stable across builds (path, or parameter and group)."""
    core = getattr(learner, "module", learner)
    named = {p: st.value for p, st in core.path_to_states.items()}
    named.update({("trace", *key): value for key, value in core.named_etraces().items()})
    return named


def gathered(value: Any) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def max_rel(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], prefix: str) -> float:
    keys = [k for k in ref if k.startswith(prefix)]
    if not keys or set(ref) != set(got):
        raise AssertionError(f"{prefix}: keys differ: {sorted(set(ref) ^ set(got))}")
    return max(float(np.max(np.abs(ref[k] - got[k]))) / max(float(np.max(np.abs(ref[k]))), 1e-30) for k in keys)


def trace_bytes(learner: Any) -> tuple[int, int]:
    """``(total bytes, bytes on the first device)`` of every eligibility trace."""
    total = per_device = 0
    for st in learner.states(braintrace.EligibilityTrace).values():
        for leaf in jax.tree.leaves(st.value):
            total += leaf.nbytes
            per_device += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == leaf.sharding.mesh.devices.flat[0])
    return total, per_device


_REFERENCES: dict[tuple[str, str], dict[str, np.ndarray]] = {}


def reference(case: Case) -> dict[str, np.ndarray]:
    """The one-device run of ``case`` (shared by its layouts)."""
    key = (case.name.split("/")[0], case.drive)
    if key not in _REFERENCES:
        _REFERENCES[key] = run(case, build(case, None), None)
    return _REFERENCES[key]


def check_case(case: Case) -> dict[str, Any]:
    """The sharded run against the one-device run of ``case``."""
    ref = reference(case)
    sharding = mesh_for(case.layout, jax.devices())
    learner = build(case, sharding)
    got = run(case, learner, sharding)
    total, per_device = trace_bytes(learner)
    return {
        "grads": max_rel(ref, got, "grad") if case.drive != "train" else None,
        "loss": max_rel(ref, got, "loss"),
        "states": max_rel(ref, got, "state"),
        "trace_bytes": total, "trace_bytes_per_device": per_device,
        "misplaced": [str(p) for p in learner.sharding_plan.misplaced()],
        "specs": {str(p): str(s) for p, s in learner.sharding_plan.specs().items()},
    }


def negative_control() -> float:
    """How far the gradients move when one weight moves by 0.1 %: what the tolerance must sit below."""
    case = cases("default")[0]
    learner = build(case, None)
    for st in learner.param_states.values():
        st.value = jax.tree.map(lambda w: w * 1.001, st.value)
    return max_rel(reference(case), run(case, learner, None), "grad")


def memory_scaling() -> dict[str, list[float]]:
    """Per-device trace bytes over total, for 1, 2, 4 and 8 devices along each axis (D_RTRL)."""
    out: dict[str, list[float]] = {}
    for layout in ("data", "model"):
        fractions = []
        for n in (1, 2, 4, 8):
            devices = jax.devices()[:n]
            learner = build(Case("", rnn, "d_rtrl", {}, layout), mesh_for(layout, devices))
            total, per_device = trace_bytes(learner)
            fractions.append(per_device / total)
        out[layout] = fractions
    return out


def step_memory(row_loop: bool = False) -> float:
    """XLA's per-device memory of one jitted ``etrace_grad`` with the batch split over 8 devices
    (outputs and temporaries; compiled, not run), over the bytes of the whole trace.

    The traces are outputs of the step, so a step that gathered the split trace onto every
    device (e.g. by indexing its batch rows one by one) would show here, not in the placed states.
    ``row_loop=True`` is that step (the negative control): the CPU row loop left on.
    """
    batch, hidden = 32, 64
    key = jax.random.PRNGKey(0)
    xs, ys = jax.random.normal(key, (2, batch, N_IN)), jax.random.normal(key, (2, batch, hidden))
    # A GRU's group reads its past, so its traces' history is contracted (a vanilla cell's has none).
    learner = braintrace.compile(braintrace.nn.GRUCell(N_IN, hidden), "d_rtrl", jnp.ones((batch, N_IN)),
                                 batch_size=batch, sharding=mesh_for("data", jax.devices()))

    def step_fn(x: Any, y: Any) -> Any:
        return jnp.mean((learner(x) - y) ** 2)

    jitted = brainstate.transform.jit(lambda xs, ys: learner.etrace_grad(xs, ys, step_fn=step_fn))
    with contextlib.ExitStack() as stack:
        if row_loop:
            stack.enter_context(mock.patch.object(sharding_module, "_rows_for", lambda plan: contextlib.nullcontext()))
        analysis = jitted.lower(xs, ys).compile().memory_analysis()
    return float(analysis.output_size_in_bytes + analysis.temp_size_in_bytes) / trace_bytes(learner)[0]


def bad_shardings() -> dict[str, str]:
    """The error message of every refused sharding."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    attempts: dict[str, Callable[[], Any]] = {
        "batch": lambda: braintrace.compile(rnn(), "d_rtrl", jnp.ones((6, N_IN)), batch_size=6,
                                            sharding=braintrace.Sharding(mesh, batch="model")),
        "hidden": lambda: braintrace.compile(braintrace.nn.ValinaRNNCell(N_IN, 6), "d_rtrl", jnp.ones((B, N_IN)),
                                             batch_size=B, sharding=braintrace.Sharding(mesh, hidden="model")),
        "unbatched": lambda: braintrace.compile(rnn(), "d_rtrl", jnp.ones(N_IN),
                                                sharding=braintrace.Sharding(mesh, batch="data")),
    }
    found = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = "no error"
        except ValueError as err:
            found[name] = str(err)
    return found


def reset_placement() -> dict[str, list[str]]:
    """What ``misplaced()`` lists after a step and a reset (jitted), and after a state is overwritten by hand."""
    sharding = mesh_for("both", jax.devices())
    out = {}
    for vmap in (False, True):
        learner = braintrace.compile(rnn(), "d_rtrl", jnp.ones((B, N_IN)), batch_size=B, vmap=vmap, sharding=sharding)
        def step_and_reset(x: Any, learner: Any = learner) -> None:
            learner(x)
            learner.reset()

        brainstate.transform.jit(step_and_reset)(jnp.ones((B, N_IN)))
        out[f"reset/vmap={vmap}"] = [str(p) for p in learner.sharding_plan.misplaced()]
        learner.hidden_states[("h",)].value = np.zeros((B, H), np.float32)
        out[f"overwritten/vmap={vmap}"] = [str(p) for p in learner.sharding_plan.misplaced()]
    return out


MULTIHOST = Case("multihost", rnn, "d_rtrl", {}, "both")


def main(out: str, grid: str) -> None:
    """Run ``grid``'s cases; the default grid also runs every other check, the rest of the grid
    the step memory of the row loop beside the split step's."""
    metrics: dict[str, Any] = {"devices": len(jax.devices())}
    sections: dict[str, Callable[[], Any]] = {
        "cases": lambda: {case.name: check_case(case) for case in cases(grid)},
        "step_memory": step_memory,
    }
    if grid == "rest":
        sections["step_memory_row_loop"] = lambda: step_memory(row_loop=True)
    else:
        sections.update(negative_control=negative_control, memory=memory_scaling, errors=bad_shardings,
                        reset=reset_placement)
    for name, section in sections.items():
        start = time.process_time()
        metrics[name] = section()
        print(f"{name}: {time.process_time() - start:.1f} s of CPU", flush=True)
    if grid != "rest":
        sharding = mesh_for("both", jax.devices()[:4])
        np.savez(os.path.join(out, "reference.npz"), **run(MULTIHOST, build(MULTIHOST, sharding), sharding))
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)


def multihost_run(out: str) -> None:
    """The multi-host case over every process's devices (``jax.distributed`` already initialised)."""
    sharding = mesh_for("both", jax.devices())
    result = run(MULTIHOST, build(MULTIHOST, sharding), sharding)
    if jax.process_index() == 0:
        np.savez(os.path.join(out, "multihost.npz"), process_count=jax.process_count(),
                 local_devices=len(jax.local_devices()), **result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
