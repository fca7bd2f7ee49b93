"""The engine every learner runs on: the custom VJP of a call (:mod:`.base`), the graph executors
that extract ``x``, ``df`` and ``D``, the call's checks, lock, placement and configuration.
"""
