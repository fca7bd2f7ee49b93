"""The other learning rules: random projections (UORO), OTTT, OTPE, BPTT, three-factor, DNI and
synthetic gradients, and the learners of the public :class:`~braintrace.TraceRule` and
:class:`~braintrace.GroupRule` contracts.
"""
