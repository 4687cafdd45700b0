"""The parent process: the `runner` and `runner-report` commands (stages 1-4 and 9 of a run).

Nothing here imports torch, torchvision or deepspeed, so `--help`, `--cfg job` and
configuration errors answer at once (tests/test_layers.py checks every module).
"""
