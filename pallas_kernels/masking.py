"""Numerics shared by the reference and the kernels."""

# A finite floor for running maxima: fully masked rows never produce exp(-inf - -inf) = NaN.
MASK_FLOOR = -1e30
