"""One rank: `python -m runner.train.worker RUN_DIR` loads the spec and runs the Trainer.

A rank never imports runner.cli or runner.launch, and never calls Hydra.
"""
