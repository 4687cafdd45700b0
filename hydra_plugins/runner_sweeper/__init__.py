"""hydra/sweeper=runner: Optuna's search with its study in the sweep directory (resumable) and
pruning (runner.sweeps)."""
