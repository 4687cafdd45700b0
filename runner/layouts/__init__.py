"""parallelism=auto's planner: every layout a run could take, checked, its memory and step
time predicted from the model itself, the fastest that fits chosen. A process of its own
(`python -m runner.layouts.planner`), which the parent runs and reads."""
