"""One rank: `python -m runner.train.worker RUN_DIR` loads the spec and runs the Trainer.

    worker.py, ray_worker.py   a rank's stages (torch elastic's process, or a Ray worker)
    trainer.py                 the loop: it builds, resumes, then delegates each step to
    build/                     the model (whole or sharded), compiled, parallelized; the data
    step/                      the microbatches' passes, the loss's divisor, grad_accum=auto
    records/                   the step log: figures, metrics.jsonl, progress, trackers
    guards/                    non-finite values, loss spikes, injected faults
    checkpoints/               when and how checkpoints are written and resumed; model.pt
    evaluation.py              validation loss and metrics over every rank's share
    callback_calls.py          the user's callbacks (runner.callbacks) at their hooks
    losses.py, metrics.py      built-in losses and metrics (components: `_target_` names them)

A rank never imports runner.cli or runner.launch, and never calls Hydra.
"""
