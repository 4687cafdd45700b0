"""Build DeepSpeed's CPU shared-memory comm op ahead of time (`make install` runs this).

DeepSpeed JIT-compiles this op the first time a CPU run initialises its comm
backend (about 45 s on 2 cores) and caches it in the environment's own
torch_extensions folder (runner.processes.keep_extensions_in_environment). Doing it at
install time means no run and no test pays for it by surprise.
"""

from __future__ import annotations

import os
import sys
import time

from runner.processes import keep_extensions_in_environment


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    keep_extensions_in_environment()
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed_ops: DeepSpeed is not installed; nothing to build", file=sys.stderr)
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print(
            "deepspeed_ops: this DeepSpeed accelerator needs no shared-memory op", file=sys.stderr
        )
        return
    started = time.time()
    builder.load(verbose=False)
    print(
        f"deepspeed_ops: {builder.absolute_name()} ready ({time.time() - started:.0f}s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
