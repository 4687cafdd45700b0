"""The records a run leaves: the step log, its figures, metrics.jsonl and the progress line."""
