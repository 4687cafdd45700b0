"""Every feature through a run's whole life: a row per feature, a column per stage of a run's
life, each cell what the docs promise (docs/faults.md's table says the same).

Stages:
- restart: a rank SIGKILLed mid-run, `max_restarts=1`: the terminal says which rank died and
  the step every rank goes back to; the run ends bit for bit on the uninterrupted run's
  weights, at its step.
- sigterm: SIGTERM while a rank is stuck in a step (`chaos.action=hang`), then `resume=auto`:
  one line says where it stands, no traceback; the resumed run ends bit for bit.
- ctrl_c: Ctrl-C typed in a real terminal, the bar drawn: exit 130, one line, no traceback.
- eval / eval_1: `runner eval RUN` at the run's nproc and at nproc=1 scores what the run's
  last evaluation scored: its val figures within 1e-6 relative.
- export: `runner export RUN --to DIR`: the safetensors hold model.pt's tensors.
- ragged: samples of many lengths (data.min_length): every stage above trains on them (the
  row's runs are ragged), or, where the feature cannot take them, they are refused before
  any rank starts (checked in-process, by the command's own checks).

A new feature adds a row (FEATURES); the rows of the smallest runs are in `make test`
(IN_MAKE_TEST), the rest in `make test-matrix`.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from runner import heartbeat
from tests.helpers.cli import HANG, MATRIX, CliResult, run_cli, start_runner, wait_until
from tests.helpers.refusals import refused
from tests.helpers.terminal import CTRL_C, command, type_in
from tests.helpers.weights import assert_exports_model_pt

pytestmark = pytest.mark.slow

STAGES = ("restart", "sigterm", "ctrl_c", "eval", "eval_1", "export", "ragged")


def gpt(corpus: Path) -> list[str]:
    """A 2-layer gpt on the test corpus: 12 steps of 8 samples, evaluated and checkpointed
    every 4 steps (its last evaluation on 2 global batches)."""
    return [
        "model=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.bias=false",
        "data=text", f"data.root={corpus}", "data.block_size=24", "loss=causal_lm",
        "metrics=language_model", "precision=fp32", "scheduler=constant",
        "global_batch_size=8", "max_epochs=null", "max_steps=12", "eval_interval=4",
        "eval_batches=2", "checkpoint.interval=4", "log_interval=2", "progress_bar=false",
    ]  # fmt: skip


def moe(corpus: Path) -> list[str]:
    """The same 2-layer gpt with a mixture of 4 experts in each block, 2 a token, balanced by
    its routing bias too (moved by the optimizer's step: not by a checkpoint's loading)."""
    moe_model = ["model=gpt_moe", "model.n_experts=4", "model.bias_update_speed=0.01"]
    return [*(a for a in gpt(corpus) if a != "model=gpt"), *moe_model]


def mlp(corpus: Path) -> list[str]:
    """The mlp on digits: a plateau early_stop.patience=2 ends at step 72 (min_delta 0.01)."""
    return [
        "model=mlp", "data=digits", "precision=fp32", "max_epochs=null", "max_steps=80",
        "eval_interval=4", "log_interval=4", "checkpoint.interval=4", "progress_bar=false",
    ]  # fmt: skip


@dataclass(frozen=True)
class Feature:
    """A row: the run's overrides, on `base`; where its rank is killed (restart) and where one
    hangs (sigterm, ctrl_c) after the checkpoint of `checkpointed`; what ragged data does
    (None: trains; else the refusal's words); stages that do not apply, and why."""

    overrides: tuple[str, ...]
    base: str = "gpt"
    nproc: int = 2
    kill_at: int = 7
    checkpointed: int = 4
    ragged_refused: str | None = None
    not_applicable: dict[str, str] = field(default_factory=dict)
    stops_early_at: int | None = None  # where the uninterrupted run stops (early_stop)


FSDP = ("parallelism=fsdp",)
FEATURES = {
    "ddp": Feature(()),
    "zero2": Feature(("parallelism=zero2",)),
    "fsdp": Feature(FSDP),
    "tensor": Feature((*FSDP, "parallelism.tensor=2")),
    "pipeline": Feature(
        (*FSDP, "parallelism.pipeline=2", "grad_accum=2"),
        ragged_refused="a pipeline's stages pass activations of one shape",
    ),
    "context": Feature((*FSDP, "parallelism.context=2")),
    "float8": Feature(("precision=float8", "precision.auto_filter=false")),
    "early_stop": Feature(
        ("early_stop.patience=2", "early_stop.min_delta=0.01"),
        base="mlp",
        kill_at=70,  # after the checkpoint of step 68, one evaluation without a gain counted
        checkpointed=68,
        not_applicable={"ragged": "digits are 8x8 images, all one shape"},
        stops_early_at=72,
    ),
    "compile": Feature(("compile={backend:aot_eager}",)),
    "selective": Feature(("activation_checkpointing=selective",)),
    "expert": Feature((*FSDP, "parallelism.expert=2"), base="moe"),
}
# the smallest rows' cases make test runs; the rest are make test-matrix's
IN_MAKE_TEST = {
    ("early_stop", "restart"),
    ("early_stop", "sigterm"),
    ("pipeline", "eval"),
    ("pipeline", "eval_1"),
    ("pipeline", "ragged"),
}


# ... and make test-floor again, on the oldest torch (torch elastic's restart, said)
ON_THE_FLOOR = {("early_stop", "restart")}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stage" not in metafunc.fixturenames:
        return
    name = metafunc.cls.name
    params = []
    for stage in STAGES:
        marks = [] if (name, stage) in IN_MAKE_TEST else [MATRIX]
        marks += [pytest.mark.floor] if (name, stage) in ON_THE_FLOOR else []
        params.append(pytest.param(stage, marks=marks, id=stage))
    metafunc.parametrize("stage", params)


@pytest.fixture(scope="class")
def feature(request: pytest.FixtureRequest) -> Feature:
    return FEATURES[request.cls.name]


RAGGED = "data.min_length=3"  # text samples of 3 to 24 tokens, padded per batch


def trains_ragged(feature: Feature) -> bool:
    return feature.base != "mlp" and feature.ragged_refused is None


@pytest.fixture(scope="class")
def args(feature: Feature, corpus: Path) -> list[str]:
    """The row's runs: ragged text where the feature takes it (one run for every stage)."""
    base = {"gpt": gpt, "moe": moe, "mlp": mlp}[feature.base](corpus)
    ragged = [RAGGED] if trains_ragged(feature) else []
    return [*base, *ragged, f"nproc={feature.nproc}", *feature.overrides]


@pytest.fixture(scope="class")
def reference(
    request: pytest.FixtureRequest, tmp_path_factory, args: list[str], feature: Feature
) -> CliResult:
    """The row's uninterrupted run, made once."""
    run = run_cli(tmp_path_factory.mktemp(request.cls.name), *args, name="reference")
    assert run.returncode == 0, run.output
    if feature.stops_early_at is not None:  # what a restart must stop at too
        assert run.summary()["stopped_early"]["after_step"] == feature.stops_early_at
    return run


class Row:
    """The stages of one feature (a class per row: pytest-xdist runs each on a worker of its
    own, its uninterrupted run made once)."""

    name = ""

    def test_stage(
        self, stage: str, feature: Feature, reference: CliResult, args: list[str], tmp_path: Path
    ) -> None:
        why = feature.not_applicable.get(stage)
        if why is not None:
            pytest.skip(f"{self.name} x {stage}: {why}")
        globals()[f"_{stage}"](feature, reference, args, tmp_path)


def _same_end(run: CliResult, reference: CliResult) -> None:
    """Bit for bit: the weights, the step it ended at, its val figures."""
    mine = torch.load(run.run_dir / "model.pt", weights_only=True)
    theirs = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert mine.keys() == theirs.keys()
    differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not differ, f"not bit for bit: {differ[:3]}"
    assert run.summary()["steps"] == reference.summary()["steps"]
    assert _val(run.summary()["final"]) == _val(reference.summary()["final"])


def _val(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k.startswith("val/")}


def _no_traceback(output: str) -> None:
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output


def _restart(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    killed = feature.nproc - 1
    chaos = [f"chaos.kill_rank={killed}", f"chaos.at_step={feature.kill_at}"]
    run = run_cli(tmp_path, *args, "max_restarts=1", *chaos)
    assert run.returncode == 0, run.output
    _no_traceback(run.stdout + run.stderr)
    said = f"runner: rank {killed} on "
    line = next((x for x in run.output.splitlines() if x.startswith(said)), None)
    assert line is not None, run.output
    assert f"was killed by SIGKILL (exitcode -9), after step {feature.kill_at - 1}" in line
    back = f"step {feature.checkpointed} (checkpoints/step_{feature.checkpointed:08d})"
    assert line.endswith(f"restart 1 of 1: every rank goes back to {back}"), line
    assert f"completed {reference.summary()['steps']} steps after 1 restart" in run.output
    assert run.summary()["restarts"] == 1
    _same_end(run, reference)


def _hung(args: list[str], feature: Feature) -> list[str]:
    """Rank 0 stuck at step kill_at for good, after the checkpoint of `checkpointed`."""
    return [*args, "chaos.action=hang", "chaos.kill_rank=0", f"chaos.at_step={feature.kill_at}"]


def _stuck(run_dir: Path, feature: Feature) -> bool:
    """Rank 0 is stuck (chaos) at step kill_at, after the checkpoint of `checkpointed`, and
    every other rank has finished the step before and waits in that one: the heartbeats of
    the run's ranks (their agent's file) say so."""
    log = run_dir / "logs" / "rank0.log"
    stuck = f"chaos: rank 0 hangs at step {feature.kill_at}"
    if not (log.is_file() and stuck in log.read_text()):
        return False
    for path in heartbeat.files():
        beats = heartbeat.read(path, feature.nproc)
        if any(beat.pid and _runs_in(beat.pid, run_dir) for beat in beats):
            done = heartbeat.finished_step(path, feature.nproc)
            return done is not None and done >= feature.kill_at - 1
    return False


def _runs_in(pid: int, run_dir: Path) -> bool:
    try:
        return str(run_dir) in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _resumed(feature: Feature, args: list[str], tmp_path: Path, name: str) -> CliResult:
    chaos_off = ["chaos.kill_rank=null", "chaos.at_step=null"]
    return run_cli(tmp_path, *args, *chaos_off, "resume=auto", name=name)


def _sigterm(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_runner(tmp_path, run_dir, *_hung(args, feature))
    wait_until(proc, lambda: _stuck(run_dir, feature))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    _no_traceback(out + err)
    where = (
        f"runner: interrupted by SIGTERM after step {feature.kill_at - 1}; resume=auto goes on "
        f"from its checkpoint of step {feature.checkpointed}"
    )
    assert where in err, err
    resumed = _resumed(feature, args, tmp_path, "run")
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary()["resumed_from"] == feature.checkpointed
    _same_end(resumed, reference)


def _ctrl_c(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [command("runner", activated=True), *_hung(args, feature), "progress_bar=true"]
    typed = type_in(
        [*argv, f"hydra.run.dir={run_dir}"],
        tmp_path,
        activated=True,
        keys=(lambda _: _stuck(run_dir, feature), CTRL_C),
    )
    assert typed.returncode == 128 + signal.SIGINT, typed.output
    _no_traceback(typed.output)
    said = f"runner: interrupted by SIGINT after step {feature.kill_at - 1}; "
    line = next((x for x in typed.lines if said in x), None)  # after the bar's clearing
    assert line is not None, typed.output
    assert line.endswith(f"(run/checkpoints/step_{feature.checkpointed:08d})"), line
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


def _evaluated(reference: CliResult, tmp_path: Path, *overrides: str) -> None:
    run = run_cli(tmp_path, "eval", str(reference.run_dir), *overrides)
    assert run.returncode == 0, run.output
    _no_traceback(run.output)
    scored = json.loads((run.run_dir / "eval.json").read_text())["metrics"]
    logged = _val(reference.summary()["final"])
    assert scored.keys() == logged.keys()
    for key, value in logged.items():
        assert scored[key] == pytest.approx(value, rel=1e-6), key


def _eval(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    _evaluated(reference, tmp_path)


def _eval_1(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    _evaluated(reference, tmp_path, "nproc=1")


def _export(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    final = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert_exports_model_pt(reference.run_dir, final, tmp_path / "exported")


def _ragged(feature: Feature, reference: CliResult, args: list[str], tmp_path: Path) -> None:
    if feature.ragged_refused is None:  # every stage's runs trained on ragged samples
        assert trains_ragged(feature) and RAGGED in args
        assert reference.summary()["status"] == "completed"
        written = yaml.safe_load((reference.run_dir / "config.yaml").read_text())
        assert (written["data"]["pack"], written["data"]["min_length"]) == (True, 3)
        return
    found = refused(*args, RAGGED)
    assert "data.pack=true data.min_length=3: samples of many lengths" in found
    assert feature.ragged_refused in found


for _name in FEATURES:  # a class per row
    globals()[f"Test{_name.title().replace('_', '')}"] = type(
        f"Test{_name.title().replace('_', '')}", (Row,), {"name": _name}
    )


def test_every_row_names_a_feature_of_the_docs_table() -> None:
    """docs/faults.md's lifecycle table has a row per feature here, and no other."""
    text = (Path(__file__).parents[1] / "docs" / "faults.md").read_text()
    table = text.split("## Every feature through a run's life", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip(" `") for line in table.splitlines() if line.startswith("| `")]
    assert rows == list(FEATURES)
