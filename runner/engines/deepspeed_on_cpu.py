"""DeepSpeed, imported as a CPU rank of a ZeRO engine imports it (runner.engines.deepspeed_ops
.import_deepspeed: the CPU accelerator, MLflow kept out): what the fork server of such a run
imports once for its ranks (runner.launch.forked_ranks.modules_for), where each rank took
about a second of CPU to import it."""

from runner.engines.deepspeed_ops import import_deepspeed

import_deepspeed("zero", "cpu")
