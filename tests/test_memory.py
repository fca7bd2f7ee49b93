"""The memory planner: ``estimate_memory`` and ``learner_memory`` against XLA and by-hand counts.

Every figure is checked against an independent computation: the test writes and lowers the
training step itself and reads ``memory_analysis()``, counts the traces from their shapes, and
compiles at the batch sizes around a budget's answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import brainstate
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import braintrace
from braintrace._footprint import MemoryEstimate
from braintrace._footprint.step_memory import StepMemory
from braintrace._memory import MemoryPlan, estimate_memory, learner_memory
from braintrace._memory import planner
from braintrace._memory.methods import read_methods

matplotlib.use("Agg")

N_IN, HIDDEN, N_OUT, BATCH = 3, 8, 2, 4
PP = ("pp_prop", {"decay_or_rank": 0.9})
PP_LABEL = "pp_prop(decay_or_rank=0.9)"


class Net(brainstate.nn.Module):
    """An RNN cell (an ETP relation: W on [x, h], and its bias) and a plain linear readout."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = braintrace.nn.ValinaRNNCell(N_IN, HIDDEN)
        self.readout = brainstate.ParamState(jnp.asarray(np.random.default_rng(0).normal(size=(HIDDEN, N_OUT)),
                                                         jnp.float32))

    def update(self, x: jax.Array) -> jax.Array:
        return self.cell(x) @ self.readout.value


def x_at(batch: int) -> jax.Array:
    return jnp.ones((batch, N_IN), jnp.float32)


def xla_memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    return {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
            "temp": stats.temp_size_in_bytes, "alias": stats.alias_size_in_bytes}


def xla_total(m: dict[str, int]) -> int:
    return m["argument"] + m["output"] + m["temp"] - m["alias"]


def online_step_by_hand(algorithm: Any, batch: int, **options: Any) -> dict[str, int]:
    """The test's own online step: a fresh learner, the gradient of its summed output, lowered."""
    learner = braintrace.compile(Net(), algorithm, x_at(batch), batch_size=batch, **options)
    params = learner.param_states

    @brainstate.transform.jit
    def step(x: jax.Array) -> Any:
        return brainstate.transform.grad(lambda: jnp.sum(learner(x)), params)()

    return xla_memory(step.lower(x_at(batch)).compile())


def bptt_step_by_hand(batch: int, seq_len: int) -> dict[str, int]:
    model = Net()
    brainstate.nn.init_all_states(model, batch_size=batch)
    params = model.states(brainstate.ParamState)

    @brainstate.transform.jit
    def step(xs: jax.Array) -> Any:
        return brainstate.transform.grad(lambda: jnp.sum(brainstate.transform.for_loop(model, xs)), params)()

    return xla_memory(step.lower(jax.ShapeDtypeStruct((seq_len, batch, N_IN), jnp.float32)).compile())


def step_fields(row: MemoryEstimate) -> dict[str, int]:
    assert row.step is not None
    return {"argument": row.step.argument_bytes, "output": row.step.output_bytes, "temp": row.step.temp_bytes,
            "alias": row.step.alias_bytes}


def assert_close(planned: dict[str, int], independent: dict[str, int]) -> None:
    """Arguments, outputs and aliases exactly; temporaries and the total within 10%."""
    for key in ("argument", "output", "alias"):
        assert planned[key] == independent[key], (key, planned, independent)
    assert planned["temp"] == pytest.approx(independent["temp"], rel=0.1), (planned, independent)
    assert xla_total(planned) == pytest.approx(xla_total(independent), rel=0.1)


@pytest.fixture(scope="module")
def plan() -> MemoryPlan:
    return estimate_memory(Net(), ["bptt", "d_rtrl", PP], x_at(BATCH), batch_size=BATCH, seq_len=4)


# --- the figures -----------------------------------------------------------------------------

def test_learner_steps_match_xla_memory_analysis(plan: MemoryPlan) -> None:
    assert_close(step_fields(plan["d_rtrl"]), online_step_by_hand("d_rtrl", BATCH))
    assert_close(step_fields(plan[PP_LABEL]), online_step_by_hand("pp_prop", BATCH, decay_or_rank=0.9))


def test_bptt_step_matches_xla_memory_analysis(plan: MemoryPlan) -> None:
    assert_close(step_fields(plan["BPTT"]), bptt_step_by_hand(BATCH, 4))


def test_trace_bytes_are_the_trace_arrays_by_hand(plan: MemoryPlan) -> None:
    float32 = 4
    weight, bias = (N_IN + HIDDEN) * HIDDEN, HIDDEN
    # D_RTRL: one trace entry per parameter and hidden state (S = 1), per sample.
    assert plan["d_rtrl"].trace_bytes == BATCH * (weight + bias) * 1 * float32
    # pp_prop: the input trace |x| = N_IN + HIDDEN and the output trace |y| = HIDDEN, per sample.
    assert plan[PP_LABEL].trace_bytes == BATCH * ((N_IN + HIDDEN) + HIDDEN) * float32
    assert plan["BPTT"].trace_bytes == 0
    learner = braintrace.compile(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH)
    assert plan["d_rtrl"].trace_bytes == sum(leaf.nbytes for leaf in jax.tree.leaves(learner.named_etraces()))


def test_param_and_state_bytes(plan: MemoryPlan) -> None:
    float32 = 4
    params = ((N_IN + HIDDEN) * HIDDEN + HIDDEN + HIDDEN * N_OUT) * float32
    hidden = BATCH * HIDDEN * float32
    for row in plan:
        assert row.param_bytes == params
    assert plan["BPTT"].state_bytes == hidden
    assert plan["d_rtrl"].state_bytes == hidden + 4  # and the step counter (int32)
    assert plan[PP_LABEL].state_bytes == hidden + 2 * 4  # and two counters


def test_total_is_arguments_plus_outputs_plus_temporaries_less_aliases(plan: MemoryPlan) -> None:
    for row in plan:
        assert row.step is not None and row.total_bytes is not None
        s = row.step
        assert row.total_bytes == s.argument_bytes + s.output_bytes + s.temp_bytes - s.alias_bytes
        # The step reads every parameter and state; the vanilla cell's D_RTRL trace holds no
        # history (h reads its past only through W), so the step writes it without reading it.
        assert row.step.argument_bytes >= row.param_bytes + row.state_bytes
        reads_traces = row.method != "d_rtrl"
        assert (row.step.argument_bytes >= row.persistent_bytes) is reads_traces


def test_bptt_memory_grows_with_seq_len_and_the_learners_do_not(plan: MemoryPlan) -> None:
    longer = estimate_memory(Net(), ["bptt", "d_rtrl"], x_at(BATCH), batch_size=BATCH, seq_len=32)
    assert longer["BPTT"].steps == 32 and plan["BPTT"].steps == 4
    assert longer["BPTT"].total_bytes > 2 * plan["BPTT"].total_bytes
    assert longer["BPTT"].temp_bytes > plan["BPTT"].temp_bytes
    assert longer["d_rtrl"].to_dict() == plan["d_rtrl"].to_dict()


def test_the_model_is_left_as_it_was() -> None:
    model = Net()
    before = {path: np.asarray(state.value) for path, state in model.states().items()}
    estimate_memory(model, ["bptt", "d_rtrl"], x_at(BATCH), batch_size=BATCH)
    after = model.states()
    assert list(after) == list(before)  # no hidden state created
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[path].value), value)


# --- budget ----------------------------------------------------------------------------------

def test_largest_batch_fits_and_the_next_does_not(plan: MemoryPlan) -> None:
    budget = 3 * plan["d_rtrl"].total_bytes
    fitted = estimate_memory(Net(), ["d_rtrl"], x_at(BATCH), batch_size=BATCH, budget_bytes=budget)
    best = fitted["d_rtrl"].max_batch_size
    assert best is not None and best > BATCH
    assert xla_total(online_step_by_hand("d_rtrl", best)) <= budget
    assert xla_total(online_step_by_hand("d_rtrl", best + 1)) > budget


def test_bptt_largest_batch_fits_and_the_next_does_not(plan: MemoryPlan) -> None:
    budget = 2 * plan["BPTT"].total_bytes
    best = estimate_memory(Net(), "bptt", x_at(BATCH), batch_size=BATCH, seq_len=4,
                           budget_bytes=budget)["BPTT"].max_batch_size
    assert best is not None and best >= BATCH
    assert xla_total(bptt_step_by_hand(best, 4)) <= budget < xla_total(bptt_step_by_hand(best + 1, 4))


def test_a_budget_below_one_sample_fits_no_batch() -> None:
    fitted = estimate_memory(Net(), ["d_rtrl"], x_at(1), batch_size=1, budget_bytes=1000)
    assert fitted["d_rtrl"].max_batch_size == 0
    assert xla_total(online_step_by_hand("d_rtrl", 1)) > 1000
    assert "max batch" in fitted.table()


# --- learner_memory --------------------------------------------------------------------------

def test_learner_memory_is_the_plans_row_and_changes_nothing(plan: MemoryPlan) -> None:
    learner = braintrace.compile(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH)
    learner(x_at(BATCH))
    before = jax.tree.map(np.asarray, {p: s.value for p, s in learner.states().items()})
    row = learner_memory(learner, x_at(BATCH))
    after = jax.tree.map(np.asarray, {p: s.value for p, s in learner.states().items()})
    jax.tree.map(np.testing.assert_array_equal, after, before)
    expected = plan["d_rtrl"]
    assert (row.method, row.batch_size, row.steps) == ("D_RTRL", BATCH, 1)
    assert (row.trace_bytes, row.param_bytes, row.state_bytes) == (
        expected.trace_bytes, expected.param_bytes, expected.state_bytes)
    assert row.step == expected.step


def test_learner_memory_of_a_vmapped_learner_counts_every_lane(plan: MemoryPlan) -> None:
    vmapped = braintrace.compile(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH, vmap=True)
    row = learner_memory(vmapped, x_at(BATCH))
    assert row.trace_bytes == plan["d_rtrl"].trace_bytes
    assert row.step is not None and row.step.argument_bytes >= row.param_bytes + row.state_bytes


def test_learner_memory_refuses_what_is_no_compiled_learner() -> None:
    with pytest.raises(TypeError, match="compiled learner"):
        learner_memory(Net(), x_at(BATCH))
    learner = braintrace.D_RTRL(Net())
    with pytest.raises(ValueError, match="not compiled"):
        learner_memory(learner, x_at(BATCH))
    compiled = braintrace.compile(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH)
    with pytest.raises(ValueError, match="example input"):
        learner_memory(compiled)
    # A plain brainstate map of a learner does not forward its parameters, as ETraceVmap does.
    with pytest.raises(TypeError, match="vmap=True"):
        learner_memory(brainstate.nn.Vmap(compiled, vmap_states="new"), x_at(BATCH))


# --- presentation ----------------------------------------------------------------------------

def test_table_dict_repr_and_plot(plan: MemoryPlan) -> None:
    lines = plan.table().splitlines()
    assert lines[0].split()[:3] == ["method", "steps", "batch"]
    assert [line.split()[0] for line in lines[1:4]] == ["BPTT", "d_rtrl", PP_LABEL]
    as_dict = json.loads(json.dumps(plan.to_dict()))
    assert [row["method"] for row in as_dict["estimates"]] == plan.methods
    assert as_dict["estimates"][1]["total_bytes"] == plan["d_rtrl"].total_bytes
    assert repr(plan).startswith("MemoryPlan(batch_size=4, seq_len=4, budget=None, backend=")
    assert "d_rtrl" in repr(plan["d_rtrl"])
    ax = plan.plot()
    assert len(ax.patches) == 5 * len(plan)
    assert [t.get_text() for t in ax.get_xticklabels()] == plan.methods
    import matplotlib.pyplot as plt
    plt.close(ax.figure)
    with pytest.raises(KeyError, match="no method 'bptt'"):
        plan["bptt"]


def test_backends_without_memory_analysis(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoAnalysis:
        def memory_analysis(self) -> None:
            return None

    class Unsupported:
        def memory_analysis(self) -> None:
            raise NotImplementedError

    assert StepMemory.of_compiled(NoAnalysis()) is None
    assert StepMemory.of_compiled(Unsupported()) is None
    monkeypatch.setattr(planner, "online_step_memory", lambda learner, inputs: None)
    unknown = estimate_memory(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH)
    assert unknown["d_rtrl"].total_bytes is None and unknown["d_rtrl"].trace_bytes > 0
    assert "n/a" in unknown.table()
    with pytest.raises(ValueError, match="memory analysis"):
        estimate_memory(Net(), "d_rtrl", x_at(BATCH), batch_size=BATCH, budget_bytes=2**20)


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size must be a positive int.*got 0"),
    ({"batch_size": 2.5}, "batch_size must be a positive int.*got 2.5"),
    ({"batch_size": True}, "batch_size must be a positive int.*got True"),
    ({"seq_len": 0}, "seq_len must be an int of at least 1.*got 0"),
    ({"budget_bytes": 0}, "budget_bytes must be a positive number.*got 0"),
    ({"budget_bytes": -5.0}, "budget_bytes must be a positive number.*got -5.0"),
    ({"budget_bytes": math.nan}, "budget_bytes must be a positive number.*got nan"),
    ({"batch_size": None, "budget_bytes": 2**20}, "budget_bytes needs batch_size"),
    ({"batch_size": 8, "budget_bytes": 2**20}, "no example input has batch_size=8 on axis 0"),
    ({"compile_options": {"batch_size": 2}}, "compile_options holds batch_size=2"),
])
def test_bad_arguments_are_refused_naming_the_value(kwargs: dict[str, Any], message: str) -> None:
    arguments = {"batch_size": BATCH, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate_memory(Net(), "d_rtrl", x_at(BATCH), **arguments)


def test_unknown_and_malformed_algorithms_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown algorithm 'd_rtlr'; valid names are \[.*'bptt'.*'d_rtrl'"):
        estimate_memory(Net(), ["bptt", "d_rtlr"], x_at(BATCH), batch_size=BATCH)
    with pytest.raises(TypeError, match="got 3 \\(int\\)"):
        estimate_memory(Net(), 3, x_at(BATCH), batch_size=BATCH)
    with pytest.raises(ValueError, match="algorithms is empty"):
        estimate_memory(Net(), [], x_at(BATCH), batch_size=BATCH)
    with pytest.raises(ValueError, match="'bptt' takes no options"):
        estimate_memory(Net(), [("bptt", {"unroll": 2})], x_at(BATCH), batch_size=BATCH)
    with pytest.raises(TypeError, match="model must be a brainstate.nn.Module, got str"):
        estimate_memory("net", "d_rtrl", x_at(BATCH), batch_size=BATCH)
    with pytest.raises(ValueError, match="give an example input"):
        estimate_memory(Net(), "d_rtrl", batch_size=BATCH)


def test_a_learner_that_fails_to_compile_is_named_with_its_cause() -> None:
    with pytest.raises(braintrace.CompilationError, match=r"pp_prop could not be built.*TypeError.*decay_or_rank"):
        estimate_memory(Net(), ["d_rtrl", "pp_prop"], x_at(BATCH), batch_size=BATCH)


def test_methods_by_class_and_config() -> None:
    config = braintrace.ETraceConfig(trace_factorization="io_factorized", decay=0.9)
    plan = estimate_memory(Net(), [braintrace.D_RTRL, config], x_at(BATCH), batch_size=BATCH)
    assert plan.methods == ["D_RTRL", repr(config)]
    assert plan["D_RTRL"].trace_bytes == BATCH * ((N_IN + HIDDEN) * HIDDEN + HIDDEN) * 4
    assert plan[repr(config)].trace_bytes == BATCH * ((N_IN + HIDDEN) + HIDDEN) * 4  # pp_prop's factors


def test_repeated_methods_get_distinct_names() -> None:
    methods = read_methods(["d_rtrl", "d_rtrl", PP, ("pp_prop", {"decay_or_rank": 0.5}), PP])
    assert [m.label for m in methods] == [
        "d_rtrl", "d_rtrl #2", PP_LABEL, "pp_prop(decay_or_rank=0.5)", f"{PP_LABEL} #2"]
    assert [m.options for m in methods][2:4] == [{"decay_or_rank": 0.9}, {"decay_or_rank": 0.5}]
    assert len(read_methods(PP)) == 1  # a pair is one method, not two
