"""Compute kernels the runtime calls, each with a plain reference (installed as autotune_kernels)."""
