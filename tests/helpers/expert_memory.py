"""A callback (`callbacks=[{_target_: expert_memory.ExpertBytes, ranks: all}]`, with this
folder as code_dir) that measures, on every rank, the most bytes of expert weights a
mixture-of-experts layer holds while it computes: at each forward pass of an `Experts`
module (after FSDP has gathered what it gathers), the bytes of this rank's tensors of its
weights. Written to expert_bytes_rank{R}.json in the run directory."""

from __future__ import annotations

import json
from typing import Any


class ExpertBytes:
    def on_fit_start(self, run: Any) -> None:
        path = run.run_dir / f"expert_bytes_rank{run.rank}.json"
        most = {"bytes": 0}

        def measure(module: Any, args: Any) -> None:
            held = 0
            for param in module.parameters(recurse=False):
                local = param.to_local() if hasattr(param, "to_local") else param
                held += local.numel() * local.element_size()
            if held > most["bytes"]:
                most["bytes"] = held
                path.write_text(json.dumps(most))

        for module in run.model.modules():
            if type(module).__name__.endswith("Experts"):  # FSDP2 renames it FSDPExperts
                module.register_forward_pre_hook(measure)
