"""Factored input/output traces: pp_prop's engine (:mod:`.pp_prop`) with its roll and solves.
"""
