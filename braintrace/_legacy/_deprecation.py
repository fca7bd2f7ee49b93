"""The deprecation notice for the v0.1 names served at the top level of ``braintrace``.

``braintrace.__getattr__`` asks :func:`legacy_attribute` for the 11 deprecated names. Each
name warns once per process (the first access), as the 0.2.0 release notes promise.
"""

from __future__ import annotations

import warnings

__all__ = ["REPLACEMENTS", "legacy_attribute", "reset_warned"]

#: Deprecated name -> what to use instead (quoted in the warning).
REPLACEMENTS: dict[str, str] = {
    "MatMulOp": "braintrace.matmul (with a brainstate.ParamState)",
    "ElemWiseOp": "braintrace.element_wise",
    "ConvOp": "braintrace.conv",
    "SpMatMulOp": "braintrace.sparse_matmul",
    "LoraOp": "braintrace.lora_matmul",
    "ETraceOp": "the braintrace ETP primitive functions (matmul, conv, ...)",
    "ETraceParam": "brainstate.ParamState together with an ETP primitive function",
    "ElemWiseParam": "brainstate.ParamState together with braintrace.element_wise",
    "NonTempParam": (
        "brainstate.ParamState with plain JAX ops (keeps the weight out of the ETP graph)"
    ),
    "FakeETraceParam": "a plain object with plain JAX ops",
    "FakeElemWiseParam": "a plain object with plain JAX ops",
}

# names that have already warned in this process
_warned: set[str] = set()


def message(name: str) -> str:
    """The warning text for ``name``."""
    return (
        f"braintrace.{name} is deprecated since 0.2.0 and will be removed in a future release; "
        f"use {REPLACEMENTS[name]} instead."
    )


def legacy_attribute(name: str, stacklevel: int = 2) -> type:
    """Return the shim class ``name``, warning on its first access in this process.

    Parameters
    ----------
    name : str
        One of :data:`REPLACEMENTS`.
    stacklevel : int
        Passed to :func:`warnings.warn`, counted from this function.

    Raises
    ------
    KeyError
        If ``name`` is not a deprecated name.
    """
    if name not in REPLACEMENTS:
        raise KeyError(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(message(name), DeprecationWarning, stacklevel=stacklevel + 1)
    import braintrace._legacy as legacy

    return getattr(legacy, name)


def reset_warned() -> None:
    """Forget which names have warned, so the next access warns again (for tests)."""
    _warned.clear()
