"""Benchmarks of the online learners against BPTT (``make bench``; not part of ``make test``).

Every figure is a ratio measured in one run on one machine: online step time over BPTT step
time, step time over its floor (a call's latency plus the trace's memory traffic), memory at T=1000 over memory at T=100.
"""
