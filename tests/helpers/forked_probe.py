"""`python -m tests.helpers.forked_probe OUT [sleep|exit CODE]`: writes what this process looks like
to OUT (JSON), for tests/test_forkserver.py to compare a forked rank with a spawned one."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGPIPE", "SIGUSR1", "SIGUSR2")


def main() -> None:
    import numpy
    from threadpoolctl import threadpool_info

    out = sys.argv[1]
    blas = [p["num_threads"] for p in threadpool_info() if p["internal_api"] == "openblas"]
    with open("/proc/self/cmdline") as f:
        cmdline = [word for word in f.read().split("\0") if word]
    info = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path_head": sys.path[:2],
        "pid": os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in SIGNALS},
        "blas_threads": blas,
        "numpy_draw": float(numpy.random.random()),
        "stdout_write_through": sys.stdout.write_through,
        "dynamo_loaded": "torch._dynamo" in sys.modules,
        "deepspeed_loaded": "deepspeed" in sys.modules,
        "threads": len(os.listdir("/proc/self/task")),
        "cmdline": cmdline,
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    print("probe: on stdout", flush=True)
    with open(out, "w") as f:
        json.dump(info, f)
    if sys.argv[2:3] == ["sleep"]:
        time.sleep(600)
    if sys.argv[2:3] == ["exit"]:
        sys.exit(int(sys.argv[3]))


if __name__ == "__main__":
    main()
