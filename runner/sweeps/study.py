"""The Optuna study of a `hydra/sweeper=runner` sweep: its pruners by name, and the study
kept in the sweep directory (`study.json`) so that the same command run again there goes on
with it.

The sweep's process is the study's only owner: it asks for trials, tells how they ended,
and answers each job's reports (runner.sweeps.study_server). It writes study.json after
every change (atomically), and a new start rebuilds the study from it: every trial under
its own number, the finished ones as they ended (value, intermediate values, the pruner's
marks), the unfinished ones queued again with their parameters.

Optuna is imported here only, and only when a study is made: it costs seconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.rundir.files import write_atomic

STUDY_FILE = "study.json"
# hydra/sweeper/pruner=NAME -> Optuna's pruner; its other keys are the pruner's arguments
PRUNERS = {
    "median": "MedianPruner",
    "hyperband": "HyperbandPruner",
    "asha": "SuccessiveHalvingPruner",
}


def make_pruner(settings: Mapping[str, Any] | None) -> Any:
    """The pruner `settings` name ({"name": "median", "n_startup_trials": 2, ...}); none:
    Optuna's NopPruner."""
    import optuna

    if not settings:
        return optuna.pruners.NopPruner()
    arguments = {k: v for k, v in settings.items() if k != "name"}
    return getattr(optuna.pruners, PRUNERS[settings["name"]])(**arguments)


class StudyFileDamaged(ValueError):
    """study.json is there but cannot be read as a study."""


def read_study_file(sweep_dir: Path) -> dict[str, Any] | None:
    """What an earlier start of the sweep kept of its study, if anything. Raises
    StudyFileDamaged, naming the file, where it is unreadable."""
    path = Path(sweep_dir) / STUDY_FILE
    if not path.is_file():
        return None
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept.get("trials"), list) or "direction" not in kept:
            raise TypeError("no trials or direction")
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise StudyFileDamaged(f"{path} cannot be read as a study ({exc})") from None
    return kept


def write_study_file(sweep_dir: Path, study: Any, name: str) -> None:
    """The study as it stands, every trial in number order."""
    from optuna.distributions import distribution_to_json

    trials = []
    for trial in study.get_trials(deepcopy=False):
        trials.append(
            {
                "number": trial.number,
                "state": trial.state.name,
                "value": trial.value,
                "params": trial.params,
                "distributions": {
                    k: json.loads(distribution_to_json(d)) for k, d in trial.distributions.items()
                },
                "intermediate_values": {str(k): v for k, v in trial.intermediate_values.items()},
                "system_attrs": trial.system_attrs,  # the pruner's marks (ASHA's rungs)
                "user_attrs": trial.user_attrs,
            }
        )
    text = json.dumps(
        {"name": name, "direction": study.direction.name.lower(), "trials": trials}, indent=1
    )
    write_atomic(Path(sweep_dir) / STUDY_FILE, text)


def rebuild_study(study: Any, kept: dict[str, Any]) -> list[int]:
    """Put the kept trials into the (new, empty) `study` under their own numbers; return the
    numbers of the unfinished ones, queued again with their parameters."""
    import warnings

    import optuna
    from optuna.distributions import json_to_distribution

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # A seeded sampler would draw its first values again: the new trials get fresh ones.
    study.sampler.reseed_rng()
    unfinished = []
    for trial in sorted(kept["trials"], key=lambda t: t["number"]):
        state = optuna.trial.TrialState[trial["state"]]
        if not state.is_finished():
            study.enqueue_trial(trial["params"])  # WAITING, the next number: its own
            unfinished.append(trial["number"])
            continue
        distributions = {
            k: json_to_distribution(json.dumps(d)) for k, d in trial["distributions"].items()
        }
        study.add_trial(
            optuna.trial.create_trial(
                state=state,
                value=trial["value"] if state != optuna.trial.TrialState.FAIL else None,
                params=trial["params"],
                distributions=distributions,
                intermediate_values={int(k): v for k, v in trial["intermediate_values"].items()},
                system_attrs=trial["system_attrs"],
                user_attrs=trial["user_attrs"],
            )
        )
    return unfinished
