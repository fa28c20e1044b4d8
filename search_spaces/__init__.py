"""Search spaces shipped with autotune (read with importlib.resources by autotune.plan.space)."""
