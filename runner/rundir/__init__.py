"""The run directory, read and written by every process (parent, agent, ranks): where each
file lives and how it is written (files), summary.json and the attempts (summary), the
checkpoints (checkpoints) and which tracker runs it logs to (tracker_runs)."""
