"""`runner eval`: a run's weights, or any parallelism's checkpoint, evaluated on the
validation data at any nproc, into eval.json; no optimizer state read, nothing trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli.evaluate import run_evaluations
from tests.helpers.cli import CONF_DIR, FAST
from tests.helpers.refusals import refused

# the progress bar left on, as a user's run has it: `runner eval` inherits the run's config
TRAIN = ["model=mlp", "data=digits", "precision=fp32", "max_steps=4", "eval_interval=2"]
TRAIN += ["checkpoint.interval=2", "log_interval=2"]


def val_at(metrics: list[dict], step: int) -> float:
    return next(m["val/loss"] for m in metrics if m["step"] == step)


@pytest.mark.slow
def test_eval_of_a_run_and_of_its_checkpoint_at_another_nproc(cli, tmp_path: Path) -> None:
    """A zero2 run (DeepSpeed's partitioned checkpoint; fsdp's DCP is read by the same code,
    tests/test_export.py): its checkpoint on one rank, its final weights on two under zero3.
    (eval_batches: tests/test_run.py's run, and the sizing test below, in-process.)"""
    run = cli(*TRAIN, "parallelism=zero2", name="train")
    assert run.returncode == 0, run.output
    metrics = run.metrics()

    checkpoint = run.run_dir / "checkpoints" / "step_00000002"
    at_two = cli("eval", str(checkpoint), "nproc=1", name="eval_checkpoint")
    assert at_two.returncode == 0, at_two.output
    assert "evaluated (eval.json) on 1 rank(s)" in at_two.output
    written = json.loads((at_two.run_dir / "eval.json").read_text())
    assert written["weights"] == str(checkpoint) and written["world_size"] == 1
    assert written["metrics"]["val/loss"] == pytest.approx(val_at(metrics, 2), rel=1e-6)
    assert not (at_two.run_dir / "model.pt").exists()  # nothing trained, nothing to keep

    # Its final weights on two ranks, under zero3 (meta_init): no optimizer, no seed weights
    # (init_from fills every tensor), the loss the run logged at its last step; the same
    # samples as on one rank.
    sharded = cli("eval", str(run.run_dir), "parallelism=zero3", name="zero3")
    assert sharded.returncode == 0, sharded.output
    assert "evaluation | val_loss" in sharded.stderr  # the progress line of an evaluation alone
    assert "none written, init_from fills every tensor" in sharded.output
    assert not (sharded.run_dir / "init").exists()
    result = json.loads((sharded.run_dir / "eval.json").read_text())
    assert result["world_size"] == 2 and result["eval_samples"] == written["eval_samples"]
    assert set(result["metrics"]) == {"val/loss", "val/accuracy"}
    assert result["metrics"]["val/loss"] == pytest.approx(val_at(metrics, 4), rel=1e-6)
    for evaluated in (at_two, sharded):  # nothing steps: no optimizer was built
        assert all(r["optimizer"] == 0 for r in evaluated.summary()["state_bytes"])


def test_eval_refuses_what_it_cannot_read(tmp_path: Path, capsys) -> None:
    """In-process, by the code `runner eval` runs (its arguments made a launch's, then the
    launch's checks); tests/test_step_time.py refuses through the command."""
    from runner.cli.evaluate import eval_argv

    for argv, said in (
        ([str(tmp_path / "nowhere")], "no such file or directory"),
        ([], "usage: runner eval SOURCE"),  # no source: the usage, as any bad input (exit 2)
    ):
        with pytest.raises(SystemExit) as stopped:
            eval_argv(argv, CONF_DIR)
        assert stopped.value.code == 2 and said in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert "init_from.path=" in refused(*eval_argv([str(tmp_path / "empty"), *FAST], CONF_DIR))


def sizing(config: dict, *overrides: str) -> tuple[list[str], list[str]]:
    base = {"model": {}, "data": {}, "nproc": 2, "nodes": 1, "global_batch_size": 64}
    sized = run_evaluations({**base, **config}, list(overrides))
    return sized.before, sized.after


def test_eval_scores_the_samples_of_the_runs_evaluations_at_any_world_size() -> None:
    """eval_batches counts the run's global batches: eval_samples; each rank's batch is as
    large as in the run's evaluations (its whole share of the global batch)."""
    ddp = {"parallelism": {"name": "ddp"}, "grad_accum": 4, "eval_batches": 2}
    assert sizing(ddp, "nproc=4") == (
        ["global_batch_size=128", "grad_accum=1"],
        ["eval_samples=128", "eval_batches=null", "eval_ranks=2"],
    )
    assert sizing(ddp)[0] == ["global_batch_size=64", "grad_accum=1"]
    assert sizing(ddp, "eval_batches=3")[1][:2] == ["eval_samples=192", "eval_batches=null"]
    assert sizing(ddp, "nproc=1", "global_batch_size=8") == (
        ["grad_accum=1"],
        ["eval_samples=128", "eval_batches=null"],
    )


def test_eval_drops_what_of_the_runs_mesh_does_not_fit() -> None:
    """A pipeline of 2 on 4 ranks (2 data ranks of 32): at nproc=1 without the pipeline, one
    data rank of 32; at its own nproc, as it ran."""
    pipeline = {"parallelism": {"name": "fsdp", "pipeline": 2}, "nproc": 4, "grad_accum": 2}
    assert sizing(pipeline, "nproc=1")[0] == [
        "parallelism.pipeline=1",
        "global_batch_size=32",
        "grad_accum=1",
    ]
    assert sizing(pipeline)[0] == ["global_batch_size=64", "grad_accum=1"]
    hsdp = {"parallelism": {"name": "fsdp", "context": 2, "replicate": 2}, "nproc": 4}
    assert sizing(hsdp, "nproc=2")[0] == [
        "parallelism.replicate=null",
        "global_batch_size=32",
        "grad_accum=1",
    ]
    assert sizing(hsdp, "nproc=1", "parallelism=ddp")[0] == ["global_batch_size=32", "grad_accum=1"]


def test_eval_never_writes_into_a_run_nor_goes_on_from_one(tmp_path: Path) -> None:
    """`runner eval RUN hydra.run.dir=RUN` (and then its hint's resume=auto) wrote an
    evaluation's config and a failed summary into the finished run (58e01cd)."""
    from runner.spec import SpecError, resolve_spec
    from tests.helpers.config import compose_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "completed"}')
    evaluation = ["model=mlp", "data=digits", "eval_only=true", f"init_from.path={run}"]
    for resume in ("resume=null", "resume=auto"):
        with pytest.raises(SpecError) as refused:
            resolve_spec(compose_config([*evaluation, resume]), run_dir=run)
        found = refused.value.problems
        assert any(
            f"hydra.run.dir={run}: holds a run already; runner eval writes into a directory "
            "of its own" in p
            for p in found
        ), found
        assert not any("use resume=auto" in p for p in found), found
    with pytest.raises(SpecError, match="resume=auto: runner eval trains nothing"):
        resolve_spec(compose_config([*evaluation, "resume=auto"]), run_dir=tmp_path / "new")
    resolve_spec(compose_config(evaluation), run_dir=tmp_path / "new")  # a directory of its own


def test_eval_of_a_chaos_drill_leaves_its_fault_injection_out(tmp_path: Path) -> None:
    """A run trained with chaos.kill_rank=1 evaluates at nproc=1: its fault injection was the
    training's, and rank 1 does not exist there (it was refused: 'must be a rank in 0..0')."""
    from runner.cli.evaluate import eval_argv
    from runner.spec import resolve_spec, save_spec
    from tests.helpers.cli import CONF_DIR
    from tests.helpers.config import compose_config

    run = tmp_path / "drill"
    run.mkdir()
    drill = ["model=mlp", "data=digits", "nproc=2", "chaos.kill_rank=1", "chaos.at_step=3"]
    save_spec(resolve_spec(compose_config([*drill, "device=cpu"])), run)
    argv = eval_argv([str(run), "nproc=1"], CONF_DIR)
    assert argv[-2:] == ["chaos.kill_rank=null", "chaos.at_step=null"] and "nproc=1" in argv


def test_eval_drops_expert_groups_its_data_ranks_cannot_hold() -> None:
    """Expert groups are cut from the data ranks: an expert=2 run evaluated on one rank
    runs without them (the same weights, every expert on the rank); on 4 ranks, with."""
    experts = {"parallelism": {"name": "fsdp", "expert": 2}, "nproc": 2}
    sized = run_evaluations({"model": {}, "data": {}, "nodes": 1, "global_batch_size": 16,
                             **experts}, ["nproc=1"])  # fmt: skip
    assert sized.before[0] == "parallelism.expert=1"
    assert "the run's expert=2 does not fit 1 data rank(s)" in sized.notes[0]
    assert "parallelism.expert=1" not in sizing(experts, "nproc=4")[0]
    assert "parallelism.expert=1" not in sizing(experts, "nproc=1", "parallelism.expert=2")[0]
