"""What a sweep's Optuna study (hydra/sweeper=runner) shares between the sweep's process and its
jobs: the study kept in the sweep directory, and the report server rank 0 asks whether to
prune (the sweep itself: runner.cli.study_sweep)."""
