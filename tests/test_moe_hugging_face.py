"""Hugging Face mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, OLMoE, built
from their configs) under fsdp as they are, and under expert parallelism through their own
base_model_ep_plan or a plan the user names (runner.models.expert_dispatch): the weights of
plain PyTorch within 1e-5, a resume at another expert degree, eval, export under Hugging
Face's per-expert names, and the plans refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runner.models.expert_split import expert_problems, named_experts
from runner.models.families import family_of
from runner.spec import resolve_spec
from tests.helpers.cli import MATRIX, run_cli
from tests.helpers.config import compose_config
from tests.helpers.equivalence import relative_error
from tests.helpers.hugging_face import MOE_MODELS, moe_args
from tests.helpers.language_model import STEPS, train_plain
from tests.helpers.shared_runs import SharedRuns

TRAINING = [
    "precision=fp32",
    "progress_bar=false",
    "scheduler=constant",
    "max_epochs=null",
    f"max_steps={STEPS}",
    "global_batch_size=16",
    "log_interval=2",
]


def _args(kind: str, corpus: Path, *more: str) -> list[str]:
    return [*moe_args(kind, corpus), *TRAINING, *more]


def _built(kind: str):
    import transformers

    model_class, config_class, values = MOE_MODELS[kind]
    config = getattr(transformers, config_class)(**values)
    with torch.device("meta"):
        return getattr(transformers, model_class)(config)


@pytest.fixture(scope="module")
def plain(corpus: Path):
    """`plain(kind)`: plain PyTorch's weights, one process on whole global batches."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def reference(kind: str) -> dict[str, torch.Tensor]:
        if kind not in made:
            spec = resolve_spec(compose_config([*_args(kind, corpus), "nproc=1"]))
            made[kind] = train_plain(spec)
        return made[kind]

    return reference


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, corpus: Path):
    """`hf_run(kind, *more)`: one run of that model with these overrides, made once."""
    runs = SharedRuns(tmp_path_factory.mktemp("moe_hf_runs"))
    return lambda kind, *more: runs(*_args(kind, corpus, *more))


# The expert=2 split run keeps checkpoints: the resume test below goes on from them.
EXPERT2 = ("nproc=2", "grad_accum=2", "parallelism.expert=2", "checkpoint.interval=2")


def _weights(result) -> dict[str, torch.Tensor]:
    return torch.load(result.run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize("kind", list(MOE_MODELS))
def test_the_config_names_the_experts_modules(kind: str) -> None:
    """transformers' own plan finds one experts module per layer, stacked by expert."""
    model = _built(kind)
    assert family_of(model).expert_patterns(model) == ["model.layers.*.mlp.experts"]
    named, unmatched = named_experts(model, None)
    assert list(named) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert unmatched == [] and expert_problems(model, 2) == []
    function = {"_target_": "tests.helpers.hugging_face.experts_of"}
    assert list(named_experts(model, function)[0]) == list(named)


@pytest.mark.parametrize(
    ("expert", "plan", "message"),
    [
        (3, None, "parallelism.expert=3: must divide the 4 experts of model.layers.0.mlp.experts"),
        (2, ["model.layers.*.mlp.expertz"],
         "parallelism.ep_plan: 'model.layers.*.mlp.expertz' names no module of "
         "MixtralForCausalLM"),
        (2, ["model.layers.*.self_attn"],
         "parallelism.ep_plan: model.layers.0.self_attn (MixtralAttention) (and 1 more) is "
         "no experts module of Hugging Face's shape"),
        (2, ["model.layers.*.mlp.gate"],  # stacked by expert, but takes no routing
         "parallelism.ep_plan: model.layers.0.mlp.gate (MixtralTopKRouter) (and 1 more) is "
         "no experts module"),
        (1, ["model.layers.*.mlp.expertz"],  # a plan is checked even where nothing splits
         "parallelism.ep_plan: 'model.layers.*.mlp.expertz' names no module"),
        (2, [], "parallelism.expert=2: MixtralForCausalLM has no mixture-of-experts layer"),
        (2, {"_target_": "tests.helpers.hugging_face.experts_of", "suffix": "self_attn"},
         "parallelism.ep_plan: model.layers.0.self_attn (MixtralAttention) (and 1 more)"),
        (2, {"_target_": "tests.helpers.hugging_face.experts_of", "suffix": 5},
         "parallelism.ep_plan: tests.helpers.hugging_face.experts_of(model) raised TypeError"),
        (2, {"_target_": "tests.helpers.hugging_face.nowhere"},
         "parallelism.ep_plan._target_=tests.helpers.hugging_face.nowhere"),
    ],
    ids=["not-dividing", "names-nothing", "not-stacked", "router", "expert1", "empty-plan",
         "function", "function-raises", "no-function"],
)  # fmt: skip
def test_a_plan_expert_parallelism_cannot_split_is_named(expert, plan, message) -> None:
    problems = expert_problems(_built("mixtral"), expert, plan)
    assert len(problems) == 1 and problems[0].startswith(message), problems


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        # fsdp with every expert on every rank trains in make test from the expert=2 run's
        # checkpoint (test_a_split_mixtral_resumes_evaluates_and_exports), to its weights
        pytest.param("mixtral", ("nproc=2", "grad_accum=2"), id="mixtral-fsdp", marks=MATRIX),
        pytest.param("mixtral", EXPERT2, id="mixtral-expert2"),
        pytest.param("mixtral", ("nproc=4", "parallelism.expert=4"), id="mixtral-expert4",
                     marks=MATRIX),
        pytest.param(
            "mixtral",
            ("nproc=2", "parallelism.expert=2", "parallelism.ep_plan=[model.layers.*.mlp.experts]"),
            id="mixtral-expert2-named", marks=MATRIX,
        ),
        pytest.param("qwen2_moe", ("nproc=4", "parallelism.expert=2"), id="qwen2_moe-expert2",
                     marks=MATRIX),
        pytest.param("olmoe", ("nproc=4", "grad_accum=2", "parallelism.expert=2"),
                     id="olmoe-expert2-shard2", marks=MATRIX),
        pytest.param("mixtral", ("nproc=4", "parallelism.expert=2", "parallelism.tensor=2"),
                     id="mixtral-expert2-tensor2", marks=MATRIX),
    ],
)  # fmt: skip
def test_a_hugging_face_moe_trains_the_weights_of_plain_pytorch(
    hf_run, plain, kind: str, layout: tuple[str, ...]
) -> None:
    """Under fsdp as it is, and with its experts split over groups of ranks (tokens sent to
    them by all-to-all): the weights of one process holding every expert, within 1e-5."""
    result = hf_run(kind, "parallelism=fsdp", *layout)
    assert relative_error(_weights(result), plain(kind)) <= 1e-5
    if any(option.startswith("parallelism.expert") for option in layout):
        assert "ranks split each layer's experts" in result.rank_log(0)


@pytest.mark.slow
def test_a_split_mixtral_resumes_evaluates_and_exports(
    tmp_path: Path, corpus: Path, hf_run
) -> None:
    """The Mixtral run with expert=2 (the split test's): its checkpoint resumes with every
    rank holding every expert (to the weights of the run that never stopped), `runner eval`
    reproduces its logged val/loss on one rank (the expert groups dropped), and `runner
    export` writes Hugging Face's per-expert names, which from_pretrained loads to model.pt's
    weights."""
    import transformers
    from safetensors import safe_open

    ep = ("nproc=2", "parallelism=fsdp", "parallelism.expert=2")
    first = hf_run("mixtral", "parallelism=fsdp", *EXPERT2)
    checkpoint = sorted((first.run_dir / "checkpoints").glob("step_*"))[0]
    resumed = hf_run("mixtral", "nproc=2", "parallelism=fsdp", f"resume={checkpoint}")
    assert resumed.summary()["resumed_from"] == int(checkpoint.name.split("_")[1])
    assert relative_error(_weights(resumed), _weights(first)) <= 1e-5

    evaluated = run_cli(tmp_path, "eval", str(first.run_dir), "nproc=1", name="eval")
    assert evaluated.returncode == 0, evaluated.output
    logged = [m["val/loss"] for m in first.metrics() if "val/loss" in m][-1]
    loss = json.loads((evaluated.run_dir / "eval.json").read_text())["metrics"]["val/loss"]
    assert loss == pytest.approx(logged, rel=1e-6)  # on one rank: expert=2 dropped
    assert "does not fit 1 data rank(s)" in evaluated.output

    from runner.export.command import main as export  # the command's code, in this process

    exported = tmp_path / "export"
    assert export([str(first.run_dir), "--to", str(exported)]) == 0
    with safe_open(exported / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    loaded = transformers.MixtralForCausalLM.from_pretrained(exported).state_dict()
    assert relative_error(loaded, _weights(first)) == 0

    # and back: init_from reads the per-expert names into the stacked experts, each rank
    # its own shards (fsdp, expert=2); the whole model's reading is
    # test_init_from_reads_a_checkpoint_of_one_tensor_per_expert's, in-process
    again = run_cli(tmp_path, "eval", str(exported), *_args("mixtral", corpus, *ep), name="eval_ep")
    assert again.returncode == 0, again.output
    loss = json.loads((again.run_dir / "eval.json").read_text())["metrics"]["val/loss"]
    assert loss == pytest.approx(logged, rel=1e-6)


@pytest.mark.parametrize("kind", list(MOE_MODELS))
def test_init_from_reads_a_checkpoint_of_one_tensor_per_expert(tmp_path: Path, kind: str) -> None:
    """What save_pretrained writes (each expert's tensors apart, Mixtral's under other module
    names too) fills the model's stacked experts, every tensor matched."""
    import transformers

    from runner.models.checkpoint_weights import weights_file
    from runner.models.pretrained import load_into, loaded_tensors, match
    from runner.spec.schema import InitFromSpec

    model_class, config_class, values = MOE_MODELS[kind]
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(0)
    saved = getattr(transformers, model_class)(config)
    saved.save_pretrained(tmp_path / "hub")
    fresh = getattr(transformers, model_class)(config)
    spec = InitFromSpec(path=str(tmp_path / "hub"))
    with weights_file(tmp_path / "hub") as file:
        assert any(".experts.3." in name for name in file.names())
        matching = match(file, loaded_tensors(fresh), spec, fresh)
        assert matching.problems(spec) == [] and not matching.missing
        load_into(fresh, file, matching)
    assert relative_error(fresh.state_dict(), saved.state_dict()) == 0


def test_a_refused_expert_degree_names_the_valid_ones() -> None:
    """A degree refused for the experts or the shard ranks lists those that divide both, as
    a refused tensor degree lists its own."""
    from runner.spec.mesh import degree_problems

    model = _built("mixtral")  # 4 experts a layer
    assert expert_problems(model, 3, None, shard=8)[0].endswith("; valid: 1, 2, 4")
    assert expert_problems(model, 8, None, shard=2)[0].endswith("; valid: 1, 2")
    degrees = {"tensor": 1, "pipeline": 1, "context": 1, "expert": 3}
    (problem,) = degree_problems(world=4, nproc=4, replicate=1, degrees=degrees)
    assert problem.startswith("parallelism.expert=3: must divide the shard ranks (4 = world 4")
    assert problem.endswith("; valid: 1, 2, 4")
