"""Per-parameter traces: D_RTRL's engine (:mod:`.d_rtrl`) with its roll, windows, backward residual
and solves, and the rules on it (EProp, SnAp, OSTL, OSTTP).
"""
