"""The plan: a layout and its rules (layout.py), the process grid it runs on (mesh_layout.py),
its pipeline schedule (schedules.py) and stage split (stage_split.py), and the search spaces
of layouts (space.py). Pure Python, no torch: the runtime and the estimator read the same facts."""
