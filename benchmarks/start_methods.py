"""`python benchmarks/start_methods.py METHOD NPROC`: how long torch elastic takes, from this
launcher's own start (its torch import included), until NPROC ranks have met in their first
collective (start_probe.py), by how the ranks are started. Prints JSON: `ready_s` (the last
rank ready) and `wall_s` (until every rank has ended).

- command: `python -m start_probe` started with Popen, as torchrun (and runner with
  start_method=spawn) start a command;
- spawn, forkserver, fork: torch elastic's own start methods, which take a Python function
  (start_probe.ready) and start it through multiprocessing;
- runner: the command, forked by runner's fork server (runner.launch.forked_ranks) from a
  process that imported torch and what ranks import before the launch.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

METHODS = ("command", "spawn", "forkserver", "fork", "runner")
HERE = Path(__file__).resolve().parent


def main() -> None:
    method, nproc = sys.argv[1], int(sys.argv[2])
    if method not in METHODS:
        sys.exit(f"method {method!r}: valid: {', '.join(METHODS)}")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(HERE))
    import torch  # noqa: F401  (the launcher's own import, as an agent pays it)

    server = None
    if method == "runner":  # forked before this process has a thread, as runner's agent does
        from runner.launch.forked_ranks import ForkServer

        server = ForkServer.start()
        server.preload(["start_probe"])
    import start_probe
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner.launch import rendezvous
    from runner.launch.forked_ranks import forked_ranks

    rendezvous.register()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id="start",
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"rank": 0},
        max_restarts=0,
        monitor_interval=0.05,
        start_method=method if method in ("spawn", "forkserver", "fork") else "spawn",
    )
    with tempfile.TemporaryDirectory() as out:
        if method in ("command", "runner"):
            with forked_ranks(server):
                elastic_launch(config, sys.executable)("-u", "-m", "start_probe", out)
        else:
            elastic_launch(config, start_probe.ready)(out)
        ended = time.time()
        ready = max(float(p.read_text()) for p in Path(out).glob("rank*"))
    if server is not None:
        server.close()
    print(json.dumps({"ready_s": ready - STARTED, "wall_s": ended - STARTED}))


if __name__ == "__main__":
    main()
