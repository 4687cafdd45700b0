"""hydra/launcher=tune: a sweep's jobs as Ray Tune trials (runner.cli.tune_sweep)."""
