"""The training methods a memory plan compares: how ``estimate_memory``'s ``algorithms`` are read.

A method is one of

* ``'bptt'`` (any case): backpropagation through time over the plan's ``seq_len`` steps;
* a learner's name (see :data:`braintrace._compile.ALGORITHM_NAMES`), an
  :class:`~braintrace.ETraceAlgorithm` subclass or an :class:`~braintrace.ETraceConfig`;
* a pair ``(one of those, {option: value})``, for a learner's own options, such as pp_prop's
  required ``decay_or_rank``.

``algorithms`` is one method, or a list (or tuple) of them; a 2-tuple whose second item is a
dict is one pair, not two methods.

Examples
--------
>>> import braintrace
>>> from braintrace._memory.methods import read_methods
>>> [m.label for m in read_methods(['bptt', 'D_RTRL', ('pp_prop', {'decay_or_rank': 0.9}), braintrace.OTTT])]
['BPTT', 'D_RTRL', 'pp_prop(decay_or_rank=0.9)', 'OTTT']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from braintrace._algorithm import ETraceAlgorithm, ETraceConfig
from braintrace._compile import ALGORITHM_NAMES, Algorithm, AlgorithmSpec

__all__ = ["Method", "read_methods", "BPTT"]

#: The name of backpropagation through time among the methods.
BPTT = "bptt"


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of a plan: what to pass to ``braintrace.compile`` and how to name it.

    Attributes
    ----------
    label : str
        The name its row gets.
    algorithm : str, ETraceAlgorithm subclass or ETraceConfig
        ``'bptt'`` for BPTT.
    options : dict
        The method's own options for ``braintrace.compile``.

    Examples
    --------
    >>> from braintrace._memory.methods import Method
    >>> Method('BPTT', 'bptt', {}).is_bptt
    True
    """

    label: str
    algorithm: Algorithm
    options: dict[str, Any]

    @property
    def is_bptt(self) -> bool:
        return isinstance(self.algorithm, str) and self.algorithm.strip().lower() == BPTT


def _valid_names() -> list[str]:
    return sorted({BPTT, *ALGORITHM_NAMES})  # "bptt" is also a learner of braintrace.compile


def _named(algorithm: object) -> tuple[str, Algorithm]:
    """The name of one algorithm and the algorithm; a ``ValueError``/``TypeError`` for one that is none."""
    if isinstance(algorithm, str):
        key = algorithm.strip().lower()
        if key == BPTT:
            return "BPTT", algorithm
        if key in ALGORITHM_NAMES:
            return algorithm.strip(), algorithm
        raise ValueError(
            f"estimate_memory: unknown algorithm {algorithm!r}; valid names are {_valid_names()}, or pass an "
            f"ETraceAlgorithm subclass, a braintrace.ETraceConfig, or a pair (algorithm, {{option: value}})."
        )
    if isinstance(algorithm, type) and issubclass(algorithm, ETraceAlgorithm):
        return algorithm.__name__, algorithm
    if isinstance(algorithm, ETraceConfig):
        return repr(algorithm), algorithm
    raise TypeError(
        f"estimate_memory: an algorithm must be a name (one of {_valid_names()}), an ETraceAlgorithm subclass, "
        f"a braintrace.ETraceConfig or a pair (algorithm, {{option: value}}), got {algorithm!r} "
        f"({type(algorithm).__name__})."
    )


def _is_pair(spec: object) -> TypeGuard[tuple[object, Mapping[object, object]]]:
    return isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping)


def read_method(spec: AlgorithmSpec) -> Method:
    """One :class:`Method` from one entry of ``algorithms``.

    Examples
    --------
    >>> from braintrace._memory.methods import read_method
    >>> read_method(('pp_prop', {'decay_or_rank': 0.5})).options
    {'decay_or_rank': 0.5}
    """
    if _is_pair(spec):
        given = dict(spec[1])
        bad = [key for key in given if not isinstance(key, str)]
        if bad:
            raise TypeError(f"estimate_memory: the options of {spec[0]!r} must be named by strings, got {bad}.")
        options = {key: value for key, value in given.items() if isinstance(key, str)}
        label, algorithm = _named(spec[0])
        if options and label == "BPTT":
            raise ValueError(
                f"estimate_memory: 'bptt' takes no options, got {options}; pass 'bptt' alone (its sequence "
                f"length is estimate_memory's seq_len)."
            )
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        return Method(f"{label}({shown})" if shown else label, algorithm, options)
    label, algorithm = _named(spec)
    return Method(label, algorithm, {})


def read_methods(algorithms: AlgorithmSpec | Sequence[AlgorithmSpec]) -> list[Method]:
    """Every :class:`Method` of ``algorithms`` (one method or a list of them), labels made unique.

    Raises
    ------
    ValueError
        For an unknown name or an empty list.
    TypeError
        For an entry that is no method.
    """
    if isinstance(algorithms, (list, tuple)) and not _is_pair(algorithms):
        specs = list(algorithms)
    else:
        specs = [algorithms]
    if not specs:
        raise ValueError(
            "estimate_memory: algorithms is empty; give one or more methods, e.g. ['bptt', 'd_rtrl']."
        )
    methods = [read_method(spec) for spec in specs]
    seen: dict[str, int] = {}
    unique = []
    for method in methods:
        seen[method.label] = seen.get(method.label, 0) + 1
        label = method.label if seen[method.label] == 1 else f"{method.label} #{seen[method.label]}"
        unique.append(dataclasses.replace(method, label=label))
    return unique
