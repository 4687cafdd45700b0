"""runner: a declarative, Hydra-driven experiment runner for distributed PyTorch training.

One folder per process, in the order a run flows through them; imports only go down
this list (tests/test_layers.py checks it):

    cli/      the parent: the `runner` and `runner-report` commands (never imports torch)
    launch/   the agent: torch's elastic agent, rendezvous, nodes, which rank failed
    train/    one rank: worker, training loop, checkpoints, metrics
    engines/  how the model is distributed and stepped: ddp, deepspeed; optimizer, precision
    models/   built-in models, and the shapes of a model's state
    data/     datasets, the global-batch sampler, loaders
    trackers/ TensorBoard, CSV, MLflow, W&B: fed by rank 0, ended by the parent
    spec/     the run spec: schema, resolution and every check made before a rank starts
    rundir/   the run directory, shared by every process: its files and how they are
              written, summary.json, checkpoints, the tracker runs it logs to
    *.py      what else every process shares: dist, hardware, heartbeat, processes,
              components, callbacks, errors, secrets
"""
