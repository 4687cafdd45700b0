"""Torch as the agent loads it: imported once, before the fork server forks (no BLAS thread
pool, no garbage collector walking the import), and quiet (torch elastic's loggers, c10's
C++ warnings), with the ranks' logs and error files where the run directory keeps them."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.processes import one_blas_thread
from runner.rundir.files import RunDir


def logs_specs(run_dir: RunDir, restarting: Callable[[int], None] | None = None) -> Any:
    """Ranks write their own logs/rank{R}.log; the agent only assigns error files. Torch
    asks for them as each attempt starts: `restarting(attempt)` hears of every restart."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RunLogsSpecs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(run_dir.logs))

        @property
        def root_log_dir(self) -> str:
            return str(run_dir.logs)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            attempt = int(next(iter(envs.values()))["TORCHELASTIC_RESTART_COUNT"]) if envs else 0
            if attempt > 0 and restarting is not None:
                restarting(attempt)
            error_files = {}
            for local_rank, env in envs.items():
                path = run_dir.error_file(int(env["RANK"]), attempt)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
                error_files[local_rank] = str(path)
                env["TORCHELASTIC_ERROR_FILE"] = str(path)  # where the rank records its exception
            consoles = dict.fromkeys(envs, "")  # "" = inherit the agent's stdout/stderr
            return LogsDest(stdouts=consoles, stderrs=dict(consoles), error_files=error_files)

    return RunLogsSpecs()


def quiet_torch_elastic() -> None:
    """runner reports failures and signals itself; torch elastic's loggers set their own
    levels (LOGLEVEL, default WARNING) as they are created, so silence each one."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates the loggers)
    import torch.distributed.launcher.api  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def import_torch() -> None:
    """Import torch, and what both this process and the fork server need of it, without
    starting numpy's OpenBLAS thread pool (it sizes its pool when it loads, from the
    environment): the fork server is forked from this process next. Without the cyclic
    garbage collector while it imports.

    torch._dynamo and Hydra's instantiate: the pre-launch check builds the optimizer on a
    probe parameter, and a torch optimizer's constructor imports torch._dynamo (1.2-1.8 s
    here). Imported once here, the fork server has them too; imported after the fork, both
    processes paid for them at once, on 2 cores beside the parent's Hydra (+0.8 s to the
    first step)."""
    with one_blas_thread():
        gc.disable()  # it would walk the growing heap over and over: a quarter of the import
        try:
            import hydra.utils  # noqa: F401
            import torch
            import torch._dynamo  # noqa: F401
        finally:
            gc.enable()


def quiet_cpp_warnings() -> None:
    """torch's C++ warnings (a TCPStore peer going away at the end of a multi-node run) are
    noise on the agent's console: unless TORCH_CPP_LOG_LEVEL says otherwise, show errors only
    (the level torch read from that variable when it loaded; c10's flag, set in place)."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    import ctypes

    import torch

    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    with contextlib.suppress(OSError, ValueError):
        ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_log_level").value = 2
