"""Where traces live: one store for every engine's carriers, reduced-precision storage, and the
roll of a trace in the backward pass.
"""
