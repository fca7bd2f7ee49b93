"""The other learning rules: random projections (UORO), OTTT, OTPE, BPTT, three-factor, DNI and
synthetic gradients, and the public :class:`~braintrace.TraceRule` contract.
"""
