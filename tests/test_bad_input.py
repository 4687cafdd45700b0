"""Bad input fails in the parent, before any rank starts: short message, no traceback, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.spec import SpecError, resolve_spec
from tests.helpers.cli import CONF_DIR, HANG
from tests.helpers.config import compose_config
from tests.helpers.refusals import refusal, refused

CONF = str(CONF_DIR)  # a folder that exists, with no .md file and no tokenizer.json


def problems(*overrides: str, cuda_devices: int = 0) -> list[str]:
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(list(overrides)), cuda_devices=cuda_devices)
    return info.value.problems


# (overrides, the text the message must contain: key=value and what is valid)
CASES = [
    (
        ["global_batch_size=63"],
        "global_batch_size=63: not divisible by world_size x grad_accum = 2 x 1 = 2",
    ),
    (["grad_accum=3"], "pick a multiple of 6"),
    (["nproc=0"], "nproc=0: must be >= 1"),
    (["nproc=many"], "nproc='many': expected an integer or one of auto"),
    (["nodes=2", "node_rank=2", "master_port=29500"], "node_rank=2: must be in 0..1 for nodes=2"),
    (["node_rank=-1"], "node_rank=-1: must be >= 0"),
    (
        ["nodes=2", "master_port=29500", "parallelism.shm_allreduce=true"],
        "parallelism.shm_allreduce=true: not possible with nodes=2 (the ranks must share one "
        "machine); valid here: null (use it where it applies) or false",
    ),
    (
        ["parallelism.shm_allreduce=sometimes"],
        "parallelism.shm_allreduce='sometimes': expected true or false or null",
    ),
    (["data=image_folder"], "data.root=null: data=image_folder reads local files"),
    (
        ["data=image_folder", "data.root=/does/not/exist"],
        "data.root='/does/not/exist': directory does not exist",
    ),
    (["data=cifar10", "data.root=/tmp"], "data=cifar10 needs the python-pickle files"),
    (
        ["sweep.metric=val/f1"],
        "sweep.metric='val/f1': not a value this run reports; valid: auto, val/loss, "
        "val/accuracy, train/loss",
    ),
    (
        ["init_from.path=/no/weights.pt"],
        "init_from.path='/no/weights.pt': no such file or directory; give a model.pt",
    ),
    (
        ["data=text", f"data.root={CONF}", "data.pattern=*.md"],
        f"data.root='{CONF}': no file matches data.pattern='*.md'",
    ),
    (
        ["data=text", f"data.root={CONF}", "data.tokenizer=/no/tokenizer.json"],
        "data.tokenizer='/no/tokenizer.json': no such file or directory",
    ),
    (
        ["data=text", f"data.root={CONF}", f"data.cache_dir={CONF}"],
        f"data.cache_dir='{CONF}': the corpus folder itself; use a folder of its own",
    ),
    (
        ["data=text", f"data.root={CONF}", f"data.tokenizer={CONF}"],
        f"data.tokenizer='{CONF}': the directory has no tokenizer.json",
    ),
    (
        ["device=cuda"],
        "device='cuda': no CUDA device is visible on this machine; valid here: auto, cpu",
    ),
    (["device=tpu"], "device='tpu': expected one of auto, cpu, cuda"),
    (["precision=fp16", "device=cpu"], "precision=fp16 needs CUDA"),
    (["master_port=70000"], "master_port=70000: must be <= 65535"),
    (["master_port=0"], "master_port=0: must be >= 1"),
    (["nodes=2"], "master_port=null: nodes=2 needs a fixed port"),
    (["max_steps=0"], "max_steps=0: must be >= 1"),
    (["max_epochs=-3"], "max_epochs=-3: must be >= 1"),
    (["max_steps=null", "max_epochs=null"], "set at least one of them"),
    (["log_interval=0"], "log_interval=0: must be >= 1"),
    (
        ["parallelism=fsdp", "parallelism.replicate=3"],
        "parallelism.replicate=3: must divide the world size nproc x nodes = 2; valid: 1, 2",
    ),
    (
        ["parallelism=zero2", "checkpoint.async=true"],
        "checkpoint.async=true: parallelism=zero2 writes its checkpoints through DeepSpeed",
    ),
    (["checkpoint.async=maybe"], "checkpoint.async='maybe': expected true or false"),
    (["mfu.gpu=X900"], "mfu.gpu='X900': not a GPU runner knows the peak of; known: B200, H200"),
    (["mfu.gpu=V100", "precision=bf16"], "mfu.gpu='V100': V100 has no bf16 peak"),
    (["mfu.peak_tflops=0"], "mfu.peak_tflops=0: must be > 0"),
    (["grad_accum=0"], "grad_accum=0: must be >= 1"),
    (["grad_accum=abc"], "grad_accum='abc': expected an integer"),
    (["optimizer.lr=-1"], "optimizer.lr=-1: expected a number > 0"),
    (["optimizer.lr=abc"], "optimizer.lr='abc': expected a number > 0"),
    (["parallelism.bucket_cap_mb=big"], "parallelism.bucket_cap_mb='big': expected a number"),
    (
        ["parallelism.static_graph=maybe"],
        "parallelism.static_graph='maybe': expected true or false",
    ),
    (["model=custom"], "model._target_=None: expected the dotted path of a class or function"),
    (["loss._target_=cross entropy"], "loss._target_='cross entropy': expected the dotted path"),
    (["data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    (["activation_checkpointing=0"], "activation_checkpointing=0: must be >= 1"),
    (["activation_memory_budget=1.5"], "activation_memory_budget=1.5: must be <= 1"),
    (
        ["parallelism=fsdp", "parallelism.tensor=3", "nproc=2"],
        "parallelism.tensor=3: a tensor-parallel group is ranks of one node, so it must divide "
        "nproc=2; valid: 1, 2",
    ),
    (
        ["parallelism=fsdp", "parallelism.tensor=2", "parallelism.replicate=2", "nproc=2"],
        "parallelism.replicate=2: replicate x shard x tensor must be the world size nproc x "
        "nodes = 2, so with parallelism.tensor=2 replicate must divide 1; valid: 1",
    ),
    (
        [
            "parallelism=fsdp",
            "parallelism.tensor=2",
            "nproc=4",
            "global_batch_size=6",
            "grad_accum=2",
        ],
        "global_batch_size=6: not divisible by data ranks (world / tensor) x grad_accum = 2 x 2",
    ),
    (
        ["activation_memory_budget=0.5"],
        "activation_memory_budget=0.5: the compiler's partitioner (AOTAutograd's, under compile",
    ),
    (
        ["activation_memory_budget=0.5", "compile=true", "activation_checkpointing=selective"],
        "activation_memory_budget=0.5 with activation_checkpointing=selective: choose one",
    ),
    (
        ["activation_checkpointing=some"],
        "activation_checkpointing='some': expected one of none, full, selective or an integer",
    ),
    (["code_dir=[no/such/dir]"], "code_dir='no/such/dir': directory does not exist"),
    (["chaos.kill_rank=5", "chaos.at_step=2"], "chaos.kill_rank=5: must be a rank in 0..1"),
    (["chaos.kill_rank=1"], "set both or neither"),
    (["chaos.action=oom", "chaos.oom_above=-1"], "chaos.oom_above=-1: must be >= 0"),
    (
        ["grad_accum=auto", "parallelism=zero3"],
        "grad_accum=auto: parallelism=zero3 is not supported",
    ),
    (["grad_accum=some"], "grad_accum='some': expected an integer or one of auto"),
    (["compile=yes"], "compile='yes': expected a mapping"),
    (
        ["compile={backend:tvm}"],
        "compile.backend='tvm': expected one of inductor, aot_eager, eager",
    ),
    (["compile={per_block:maybe}"], "compile.per_block='maybe': expected true or false or null"),
    (
        ["compile=true", "parallelism.bucket_cap_mb=0.5"],
        "parallelism.bucket_cap_mb=0.5: with compile, dynamo's DDP optimizer needs buckets",
    ),
    (["compile={modes:max}"], "compile.modes: unknown key; valid keys here: backend, fullgraph"),
    (["resume=/no/such/checkpoint"], "resume='/no/such/checkpoint': no such file or directory"),
    (
        ["parallelism=fsdp", "sync_strategy=forced_sync"],
        "sync_strategy=forced_sync: parallelism=fsdp reduces gradients itself",
    ),
    (
        ["parallelism=zero2", "sync_strategy=forced_sync"],
        "sync_strategy=forced_sync: parallelism=zero2 reduces gradients itself",
    ),
    (
        ["parallelism=zero1", "parallelism.overlap_comm=yes"],
        "parallelism.overlap_comm='yes': expected",
    ),
    (
        ["parallelism=zero2", "parallelism.reduce_bucket_size=1e3"],
        "reduce_bucket_size=1000.0: expected an integer",
    ),
    (["parallelism=zero2", "parallelism.offload_optimizer=gpu"], "expected one of none, cpu"),
    (
        ["parallelism=zero3", "sync_strategy=multi_auto_sync"],
        "sync_strategy=multi_auto_sync: parallelism=zero3 reduces gradients itself",
    ),
    (["parallelism=zero3", "parallelism.offload_param=nvme"], "expected one of none, cpu"),
    (
        ["parallelism=zero3", "parallelism.prefetch_bucket_size=-1"],
        "parallelism.prefetch_bucket_size=-1: must be >= 0",
    ),
    (
        [
            "parallelism=zero3",
            "+parallelism.deepspeed_config.zero_optimization.stage3_prefetch_bucket_size=10",
        ],
        "zero_optimization.stage3_prefetch_bucket_size=10: conflicts with "
        "parallelism.prefetch_bucket_size=0",
    ),
    (
        ["parallelism=zero2", "+parallelism.deepspeed_config.train_batch_size=128"],
        "parallelism.deepspeed_config.train_batch_size=128: conflicts with global_batch_size=64 "
        "(which gives 64)",
    ),
    (
        ["parallelism=zero2", "+parallelism.deepspeed_config.bf16.enabled=true"],
        "parallelism.deepspeed_config.bf16.enabled=True: conflicts with precision='fp32'",
    ),
    (
        ["parallelism=zero1", "+parallelism.deepspeed_config.optimizer.type=Adam"],
        "parallelism.deepspeed_config.optimizer.type='Adam': conflicts with optimizer='adamw' "
        "(runner sets this itself)",
    ),
    (
        ["parallelism=zero1", "+parallelism.deepspeed_config.scheduler.type=WarmupLR"],
        "conflicts with scheduler='cosine'",
    ),
    (
        ["parallelism=zero2", "+parallelism.deepspeed_config.gradient_clipping=1.0"],
        "gradient_clipping=1.0: conflicts with grad_clip_norm=None (which gives 0.0)",
    ),
    (
        ["parallelism=zero2", "+parallelism.deepspeed_config.zero_optimization.stage=3"],
        "zero_optimization.stage=3: conflicts with parallelism='zero2'",
    ),
    (
        ["eval_batches=2", "eval_samples=100"],
        "eval_samples=100: eval_batches=2 is set too; set one of them (eval_batches=null)",
    ),
    (  # without patience too: the metric is named, so it is checked
        ["early_stop.metric=val/nonexistent"],
        "early_stop.metric='val/nonexistent': not a value this run evaluates; valid: auto, "
        "val/loss, val/accuracy",
    ),
    *(
        (
            [
                "model=gpt",
                "data=text",
                f"data.root={CONF_DIR.parent}",  # a corpus of one text file, not /tmp's
                "data.pattern=constraints.txt",  # (a .txt there was another test's, or none)
                "loss=causal_lm",
                "parallelism=fsdp",
                "parallelism.pipeline=2",
                "nproc=2",
                "grad_accum=2",
                ragged,
            ],
            f"{shown}: samples of many lengths, and a pipeline's stages pass activations of one "
            "shape (parallelism.pipeline=2); use data.pack=true data.min_length=null",
        )  # fmt: skip
        for ragged, shown in [
            ("data.pack=false", "data.pack=false data.min_length=null"),
            ("data.min_length=8", "data.pack=true data.min_length=8"),
        ]
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_value_is_named(overrides: list[str], expected: str) -> None:
    found = problems(*overrides)
    assert any(expected in p for p in found), found


def test_deepspeed_config_merges_what_runner_does_not_model() -> None:
    from runner.spec.deepspeed_config import merge_user_config

    spec = resolve_spec(
        compose_config(
            [
                "parallelism=zero2",
                "+parallelism.deepspeed_config.train_batch_size=64",  # agrees: fine
                "+parallelism.deepspeed_config.zero_optimization.round_robin_gradients=true",
                "+parallelism.deepspeed_config.communication_data_type=fp32",
            ]
        )
    )
    config, problems = merge_user_config(spec)
    assert problems == []
    assert config["zero_optimization"]["round_robin_gradients"] is True
    assert config["zero_optimization"]["stage"] == 2
    assert config["communication_data_type"] == "fp32"
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (64, 1)
    assert config["train_micro_batch_size_per_gpu"] == 32
    assert (
        config["gradient_clipping"] == 0.0
    )  # off unless grad_clip_norm: DeepSpeed's default clips


def test_missing_deepspeed_is_named(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else real(name, *a),
    )
    found = problems("parallelism=zero1")
    assert any("parallelism=zero1: needs DeepSpeed, which is not installed" in p for p in found)


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_a_missing_tracker_package_names_its_extra(monkeypatch, package: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    assert problems(f"logger=[tensorboard,{package}]") == [
        f"logger={package}: needs the {package} package, which is not installed "
        f"(pip install 'runner[{package}]')"
    ]


def test_compile_on_cpu_without_a_cpp_compiler_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/no/such/g++")
    assert problems("compile=true", "device=cpu") == [
        "compile.backend=inductor: on CPU it builds C++ kernels with /no/such/g++, which is not "
        "on PATH; install a C++ compiler (Debian/Ubuntu: apt-get install g++; or set CXX), or "
        "use compile={backend:aot_eager}"
    ]
    resolve_spec(compose_config(["compile={backend:aot_eager}", "device=cpu"]))  # no C++ needed


@pytest.mark.parametrize(
    "given",
    [
        ["compile={mode:reduce-overhead}"],
        ["compile={mode:reduce-overhead,backend:inductor,per_block:true}"],
        ["compile={mode:max-autotune,fullgraph:true}"],
    ],
)
def test_a_hint_typed_as_shown_is_taken(given: list[str]) -> None:
    """A refusal's `use KEY=VALUE`, typed in place of the compile overrides, resolves."""
    found = problems("model=gpt", "device=cpu", *given)
    hint = found[0].rpartition("use ")[2]
    assert hint.startswith("compile="), found
    resolve_spec(compose_config(["model=gpt", "device=cpu", hint]))


def test_every_problem_is_reported_at_once() -> None:
    found = problems("grad_accum=0", "nproc=0", "device=tpu")
    assert len(found) == 3, found


def test_cuda_checks_use_the_visible_device_count() -> None:
    assert "only 2 CUDA device(s) visible" in problems("device=cuda", "nproc=4", cuda_devices=2)[0]
    spec = resolve_spec(compose_config(["device=auto", "nproc=auto"]), cuda_devices=4)
    assert (spec.device, spec.nproc) == ("cuda", 4)


CLI_CASES = [
    (["global_batch_size=63"], "global_batch_size=63"),
    (["nproc=0"], "nproc=0: must be >= 1"),
    (["device=cuda"], "device='cuda'"),
    (["precision=fp16"], "precision=fp16 needs CUDA"),
    (["data=image_folder", "data.root=missing_dir"], "directory does not exist"),
    (["activation_checkpointing=full"], "activation_checkpointing=full: Sequential has no blocks"),
    (
        ["parallelism=fsdp", "parallelism.wrap=[Blok]"],
        "parallelism.wrap=['Blok']: Sequential has no module of that class; it has Flatten, Linear",
    ),
    (
        ["parallelism=fsdp", "parallelism.tensor=2"],
        "parallelism.tensor=2: Sequential has no tensor-parallel plan (runner's gpt has one, as do "
        "Hugging Face models with a base_model_tp_plan)",
    ),
    # Hydra's composition errors, reported the same way
    (["parallelism=zero4"], "parallelism=zero4: no such parallelism option; valid: auto, ddp,"),
    (
        ["parallelism=zero2", "parallelism.tensor=2"],
        "parallelism.tensor=2: not a key of the chosen parallelism option; only of "
        "parallelism=fsdp (tensor parallelism splits layers into DTensor shards",
    ),
    (["nprocs=2"], "nprocs=2: unknown key; did you mean nproc?"),
    (
        ["parallelism=zero2", "parallelism.bucket_cap_mb=1"],
        "parallelism.bucket_cap_mb=1: not a key of the chosen parallelism option; only of "
        "parallelism=ddp",
    ),
    (
        ["logger=[tensorboard,mlflw]"],
        "logger=mlflw: no such logger option; valid: csv, mlflow, none, tensorboard, wandb",
    ),
    (["tensorboard=false"], "tensorboard=false: unknown key; the logger group now: logger=none"),
    (
        ["+recipe=nope"],
        "+recipe=nope: no such recipe option; valid: gpt_moe_text, gpt_text, mlp_digits,",
    ),
    (["nproc=[1"], "nproc=[1: not a valid override"),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES]
)
def test_refused_before_any_rank_starts(overrides: list[str], expected: str) -> None:
    """What the command refuses (exit 2, before any rank), found in-process by the code it
    runs (tests.helpers.refusals); test_the_command_refuses_each_kind... runs it for real."""
    assert expected in refused(*overrides)


# Components are checked by the agent (torch is loaded there, never in the parent): every
# `_target_` imports and binds to its signature, all problems at once, before any rank starts.
COMPONENT_CASES = [
    (
        [
            "+model.hidden_size=[8]",
            "+loss.label_smothing=0.1",
            "+metrics.f1._target_=nosuchpkg.F1",
            "+metrics.pi._target_=math.pi",
            "data._target_=runner.data.digits.digitz",
        ],
        [
            "model.hidden_size: unexpected argument of runner.models.builders.mlp; "
            "did you mean hidden_sizes?",
            "loss.label_smothing: unexpected argument of runner.train.losses.CrossEntropy; "
            "did you mean label_smoothing?",
            "metrics.f1._target_=nosuchpkg.F1: no module named 'nosuchpkg'",
            "metrics.pi._target_=math.pi: is a float, not a class or function",
            "data._target_=runner.data.digits.digitz: runner.data.digits has no attribute "
            "'digitz'; did you mean digits?",
        ],
    ),
    (
        [
            "model=custom",
            "model._target_=torch.nn.Linear",
            "+model._args_=[64]",
            "+model.in_features=64",
        ],
        [
            "model.in_features: given twice to torch.nn.Linear, by `_args_` and by name",
            "model.out_features: missing; torch.nn.Linear needs it (set +model.out_features=...)",
        ],
    ),
    (
        [
            "model=custom",
            "model._target_=torch.nn.Linear",
            "+model.in_features=abc",
            "+model.out_features=2",
            "+model.bias=maybe",
        ],
        [
            "model.in_features='abc': expected int (as torch.nn.Linear annotates it)",
            "model.bias='maybe': expected bool (as torch.nn.Linear annotates it)",
        ],
    ),
    (
        [
            "optimizer=custom",
            "optimizer._target_=torch.nn.Linear",
            "+optimizer.in_features=2",
            "scheduler=custom",
            "scheduler._target_=torch.optim.lr_scheduler.StepLR",
        ],
        [
            "optimizer._target_=torch.nn.Linear: Linear is not an optimizer "
            "(a torch.optim.Optimizer subclass, or a function returning one)",
            "scheduler.step_size: missing; torch.optim.lr_scheduler.StepLR needs it "
            "(set +scheduler.step_size=...)",
        ],
    ),
    (
        ["optimizer.lr_multipliers={layers.9: 2.0}", "optimizer.no_weight_decay=[bias,head]"],
        [
            "optimizer.lr_multipliers: 'layers.9': matches no parameter of",
            "optimizer.no_weight_decay: 'head': matches no parameter of",
        ],
    ),
]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    COMPONENT_CASES,
    ids=["bind and import", "missing and twice", "types", "optimizer", "patterns"],
)
def test_components_are_checked_before_any_rank_starts(
    overrides: list[str], expected: list[str]
) -> None:
    """The agent's check (it has torch loaded; the parent never does): every problem at
    once, each line as the command prints it."""
    found = refusal(*overrides)
    assert len(found) == len(expected), found
    for line in expected:
        assert any(problem.startswith(line) for problem in found), (line, found)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimizer.weight_decai=0.1", "unknown key; did you mean optimizer.weight_decay"),
        ("max_step=3", "max_step=3: unknown key; did you mean max_steps?"),
        ("data.bach=3", "data.bach=3: unknown key; `runner --cfg job` shows every key"),
        (
            "compile.mode=max-autotune",
            "compile is false here; give its options as a mapping: compile={mode:max-autotune}",
        ),
        (
            "model=vit",
            "model=vit: no such model option; valid: custom, gpt, gpt_moe, mlp, resnet18, resnet50",
        ),
    ],
)
def test_composition_errors_name_the_override_and_what_is_valid(
    override: str, expected: str
) -> None:
    from hydra.errors import HydraException

    from runner.cli.compose_errors import composition_problem

    with pytest.raises(HydraException) as info:
        compose_config([override])
    assert expected in composition_problem(info.value, [override])


def test_a_key_a_recipe_set_says_so() -> None:
    """A recipe's model keys under model=custom: named with where they came from (the agent
    reports them; the parent knows the command line)."""
    from runner.cli.compose_errors import with_origins

    found = [
        "model.n_layer: unexpected argument of pkg.Net; it takes config (~model.n_layer drops it)",
        "model.width: unexpected argument of pkg.Net; did you mean widths?",
    ]
    typed = ["+recipe=gpt_text", "model=custom", "model._target_=pkg.Net", "+model.width=3"]
    assert with_origins(found, typed) == [
        "model.n_layer (set by +recipe=gpt_text): unexpected argument of pkg.Net; it takes "
        "config (~model.n_layer drops it)",
        found[1],  # typed on the command line
    ]
    assert with_origins(found, typed[1:]) == found  # no recipe


def test_every_key_the_chosen_option_lacks_is_named_not_only_the_first() -> None:
    """Hydra stops at the first; ddp lacks both of fsdp's mesh keys, so both are named (a
    key ddp has, and a key no option has, are not)."""
    from hydra.errors import HydraException

    from runner.cli.compose_errors import composition_problems

    given = ["parallelism.pipeline=2", "parallelism.bucket_cap_mb=4", "parallelism.context=2"]
    with pytest.raises(HydraException) as info:
        compose_config(given)
    found = composition_problems(info.value, given)
    assert [p.partition(":")[0] for p in found] == [given[0], given[2]], found
    expected = "not a key of the chosen parallelism option; only of parallelism=fsdp"
    assert all(expected in p for p in found)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["hydra/launcher=runner", "hydra.launcher.fail_fast=maybe"],
            "hydra.launcher.fail_fast=maybe: not a valid bool; valid: true or false",
        ),
        (
            ["hydra/sweeper=runner", "hydra.sweeper.n_trials=many"],
            "hydra.sweeper.n_trials=many: not a valid integer; valid: a whole number",
        ),
        (  # 58fe533 pointed at `runner --cfg job`, which does not show Hydra's own keys
            ["hydra/launcher=runner", "hydra.launcher.devicez=[0]"],
            "hydra.launcher.devicez=[0]: unknown key; `runner hydra/launcher=NAME --cfg hydra "
            "--package hydra.launcher` shows its keys",
        ),
    ],
)
def test_a_typed_hydra_key_given_the_wrong_type_names_what_is_valid(
    overrides: list[str], expected: str
) -> None:
    """The launcher's and sweeper's keys are typed (their dataclasses): a value of another
    type is named with what is valid, not as Hydra's "Error merging override"."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from runner.cli.compose_errors import composition_problem
    from tests.helpers.cli import CONF_DIR

    conf = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
    with pytest.raises(HydraException) as info, conf:
        compose(config_name="config", overrides=overrides, return_hydra_config=True)
    assert composition_problem(info.value, overrides) == expected


# One refusal of each kind through the real command (a check of the spec in the parent,
# Hydra's composition, an override it cannot parse, the agent's check of the components, a
# sweep's job): exit 2, one short message, no traceback, nothing written where it ran (no
# runs/ directory either). Every other refusal is checked in-process above, by the same code.
COMMAND_CASES = [
    (["global_batch_size=63"], ["global_batch_size=63: not divisible by world_size"]),
    (
        ["parallelism=zero2", "parallelism.tensor=2"],
        ["parallelism.tensor=2: not a key of the chosen parallelism option; only of"],
    ),
    (["nproc=[1"], ["nproc=[1: not a valid override"]),
    COMPONENT_CASES[0],
    (["-m", "model=mlp,vit"], ["model=vit: no such model option"]),  # before any job
]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    COMMAND_CASES,
    ids=["spec", "composition", "override", "components", "sweep"],
)
@pytest.mark.slow
def test_the_command_refuses_each_kind_with_one_message_and_writes_nothing(
    tmp_path: Path, overrides: list[str], expected: list[str]
) -> None:
    import subprocess

    from tests.helpers.cli import child_env, runner_command

    proc = subprocess.run(
        runner_command(*overrides),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    count = f"{len(expected)} problem" + ("s" if len(expected) > 1 else "")
    assert f"runner: invalid configuration ({count}):" in proc.stderr, proc.stderr
    for line in expected:
        assert f"  - {line}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], "a refused run or sweep writes nothing"
