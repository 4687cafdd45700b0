"""hydra/launcher=runner: a sweep's jobs side by side on one node, each in its own slot of
devices (runner.sweeps.slots)."""
