"""hydra/launcher=tune: a sweep's jobs as Ray Tune trials (runner.sweeps.tune_sweep)."""
