"""Mixture-of-experts models (model=gpt_moe, runner.models.moe): the layer against a plain
per-token reference, its balance losses' gradient, its counts, and whole runs: refused
options, every split training the weights of plain PyTorch with the balance losses on, the
balance losses doing their job, and a run that is killed and restarts."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from runner.models.gpt_moe import GPTMoE
from runner.models.grouped_experts import expert_loop as _expert_loop
from runner.models.grouped_experts import grouped as _grouped
from runner.models.grouped_experts import grouped_on_cpu
from runner.models.moe import STAT_AUX, STAT_DROPPED, STAT_Z, Experts, MoE
from runner.spec import RunSpec, resolve_spec
from tests.helpers.cli import MATRIX, REPO, run_cli
from tests.helpers.config import compose_config
from tests.helpers.equivalence import relative_error
from tests.helpers.language_model import lm_args, train_plain
from tests.helpers.refusals import refused
from tests.helpers.shared_runs import SharedRuns

WIDTH, EXPERTS = 16, 4
HELPERS = REPO / "tests" / "helpers"


def _layer(**options) -> MoE:
    torch.manual_seed(0)
    return MoE(WIDTH, EXPERTS, options.pop("top_k", 2), 8, **options)


def _reference(layer: MoE, x: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its chosen experts one by one, weighted by its gates."""
    tokens = x.reshape(-1, WIDTH)
    logits = tokens @ layer.router.weight.T
    scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
    top = scores.topk(layer.top_k, dim=-1)
    gates = top.values
    if layer.normalize_gates:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(layer.top_k):
            if kept is not None and not kept[t, j]:
                continue
            e = top.indices[t, j]
            hidden = F.gelu(tokens[t] @ layer.experts.w1[e])
            out[t] += gates[t, j] * (hidden @ layer.experts.w2[e])
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view_as(x)


@pytest.mark.parametrize(
    "options",
    [{}, {"top_k": 1}, {"score": "sigmoid"}, {"n_shared": 1}, {"top_k": 3, "score": "sigmoid"}],
    ids=["softmax-top2", "top1", "sigmoid", "shared", "sigmoid-top3"],
)
def test_dropless_layer_sends_each_token_through_its_experts(options) -> None:
    layer = _layer(**options)
    x = torch.randn(3, 5, WIDTH)
    with torch.no_grad():
        assert torch.allclose(layer(x), _reference(layer, x), atol=1e-6)


def _balance_losses(layer: MoE, x: torch.Tensor, real: torch.Tensor) -> tuple:
    """The sequence-wise balance loss and z-loss summed over sequences, written out plainly."""
    aux = z = torch.zeros(())
    for b in range(x.shape[0]):
        tokens = x[b][real[b].bool()]
        logits = tokens @ layer.router.weight.T
        scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
        chosen = scores.topk(layer.top_k, dim=-1).indices
        share = torch.stack([(chosen == e).sum() for e in range(EXPERTS)]).float()
        share = share * EXPERTS / (layer.top_k * len(tokens))
        aux = aux + (share * probs.mean(0)).sum()
        z = z + logits.logsumexp(-1).square().mean()
    return aux, z


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balance_losses_reach_the_gradient_as_if_added_to_the_loss(score: str) -> None:
    """The layer hands its balance losses' gradient to the backward pass itself, weighted by
    what the trainer says a sequence weighs: the gradients are those of adding the losses
    (written out plainly here, padding left out) to the loss."""
    attached = _layer(score=score, aux_loss_weight=0.3, z_loss_weight=0.05)
    plain = copy.deepcopy(attached)
    plain.aux_loss_weight = plain.z_loss_weight = 0.0
    attached.train(), plain.train()
    attached.state.penalty_scale = lambda: 0.25
    x = torch.randn(3, 6, WIDTH)
    real = torch.ones(3, 6)
    real[1, 4:] = 0  # padding
    attached.state.token_mask = plain.state.token_mask = real
    probe = torch.randn(3, 6, WIDTH)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (attached(x1) * probe).sum().backward()
    aux, z = _balance_losses(plain, x2, real)
    ((plain(x2) * probe).sum() + 0.25 * (0.3 * aux + 0.05 * z)).backward()
    assert torch.allclose(attached.router.weight.grad, plain.router.weight.grad, atol=1e-6)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6)
    assert not torch.allclose(  # the balance losses do move the router
        attached.router.weight.grad, _router_grad_without_losses(plain, x, probe), atol=1e-4
    )
    stats = attached.state.take_stats()
    assert stats is not None and attached.state.take_stats() is None
    assert stats[EXPERTS + STAT_AUX].item() == pytest.approx(aux.item(), rel=1e-5)
    assert stats[EXPERTS + STAT_Z].item() == pytest.approx(z.item(), rel=1e-5)
    assert stats[:EXPERTS].sum().item() == real.sum().item() * attached.top_k


def _router_grad_without_losses(layer: MoE, x: torch.Tensor, probe: torch.Tensor):
    layer = copy.deepcopy(layer)
    layer.router.weight.grad = None
    (layer(x) * probe).sum().backward()
    return layer.router.weight.grad


def test_a_recompute_counts_nothing_twice_and_evaluation_nothing() -> None:
    """Activation checkpointing runs the layer again in the backward pass: its counts and
    its balance losses' gradient are the first pass's only."""
    layer = _layer(aux_loss_weight=0.1)
    layer.train()
    x = torch.randn(2, 5, WIDTH, requires_grad=True)
    layer(x).sum().backward()
    plain_stats, plain_grad = layer.state.take_stats(), layer.router.weight.grad.clone()
    layer.router.weight.grad = None
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert torch.equal(layer.state.take_stats(), plain_stats)
    assert torch.allclose(layer.router.weight.grad, plain_grad, atol=1e-7)
    layer.eval()
    with torch.no_grad():
        layer(x)
    assert layer.state.take_stats() is None


def test_capacity_drops_the_overflow_and_counts_it() -> None:
    """An expert takes its first ceil(c x assignments / experts) assignments in token order;
    the rest weigh nothing in the output, and are counted."""
    layer = _layer(top_k=1, capacity_factor=0.5)
    layer.train()
    x = torch.randn(2, 8, WIDTH)
    out = layer(x)
    stats = layer.state.take_stats()
    chosen = (x.reshape(-1, WIDTH) @ layer.router.weight.T).topk(1, dim=-1).indices[:, 0]
    capacity = 2  # ceil(0.5 x 16 / 4)
    seen = [0] * EXPERTS
    kept = torch.zeros(16, 1, dtype=torch.bool)
    for t, e in enumerate(chosen.tolist()):
        kept[t, 0] = seen[e] < capacity
        seen[e] += 1
    assert not kept.all(), "the test wants some overflow"
    assert torch.allclose(out, _reference(layer, x, kept), atol=1e-6)
    assert stats[EXPERTS + STAT_DROPPED].item() == (~kept).sum().item()
    assert stats[:EXPERTS].tolist() == [float(n) for n in seen]


def test_bias_balancing_moves_the_bias_toward_the_idle_experts() -> None:
    layer = _layer(top_k=1, bias_update_speed=0.01)
    layer.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    # the bias chooses, the scores weigh: a large bias sends every token to expert 1
    layer.expert_bias.copy_(torch.tensor([0.0, 10.0, 0.0, 0.0]))
    layer.train()
    x = torch.randn(2, 4, WIDTH)
    out = layer(x)
    assert layer.state.take_stats()[:EXPERTS].tolist() == [0.0, 8.0, 0.0, 0.0]
    hidden = F.gelu(x @ layer.experts.w1[1]) @ layer.experts.w2[1]
    gate = (x @ layer.router.weight.T).softmax(-1)[..., 1:2]
    assert torch.allclose(out, gate * hidden, atol=1e-6)
    layer.bias_update_speed = 0.0  # off: the bias chooses nothing
    layer(x)
    assert layer.state.take_stats()[:EXPERTS].tolist() != [0.0, 8.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"top_k": 5}, "model.top_k=5: must be between 1 and model.n_experts=4"),
        ({"score": "relu"}, "model.score='relu': must be one of softmax, sigmoid"),
        ({"capacity_factor": 0.0}, "model.capacity_factor=0.0: must be above 0"),
        ({"aux_loss_weight": -0.1}, "model.aux_loss_weight=-0.1: must be 0 (off) or more"),
        ({"z_loss_weight": -1.0}, "model.z_loss_weight=-1.0: must be 0 (off) or more"),
        ({"bias_update_speed": -0.1}, "model.bias_update_speed=-0.1: must be 0 (off) or more"),
    ],
    ids=["top_k", "score", "capacity", "aux", "z", "bias"],
)
def test_an_option_out_of_range_is_refused_naming_its_key(options, message: str) -> None:
    """The layer checks its options as it is built: before any rank starts, the model is
    built on the meta device, and the message is the problem shown."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _layer(**options)


@pytest.mark.parametrize("hidden", [8, 3])
def test_the_cpus_grouped_product_computes_what_the_loop_over_experts_does(hidden: int) -> None:
    """On a CPU whose torch has it, the experts run through torch's grouped product (its
    outputs keep one size, where the loop's pieces fragment glibc's heap); rows whose
    strides are not multiples of 16 bytes (hidden=3) take the loop. Both give the loop's
    outputs and gradients, an expert without tokens among them."""
    torch.manual_seed(0)
    experts = Experts(EXPERTS, WIDTH, hidden)
    x = torch.randn(10, WIDTH, requires_grad=True)
    counts = torch.tensor([4, 0, 5, 1])
    assert _grouped(x, experts.w1) == (hidden == 8 and grouped_on_cpu(torch.float32))
    out = experts.compute(x, counts)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, experts.w1, experts.w2), grad)
    want_out = _expert_loop(x, counts, experts.w1, experts.w2)
    want = torch.autograd.grad(want_out, (x, experts.w1, experts.w2), grad)
    assert torch.allclose(out, want_out, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_runners_experts_keep_transformers_experts_contract() -> None:
    """gpt_moe's experts module is one of Hugging Face's shape (runner.models.expert_dispatch):
    parameters stacked by expert, forward(hidden, top_k_index, top_k_weights) the weighted
    sum of each token's experts' outputs, so one dispatch splits it and a transformers one."""
    from runner.models.expert_dispatch import stacked_experts

    torch.manual_seed(0)
    experts = Experts(EXPERTS, WIDTH, 8)
    assert stacked_experts(experts) == EXPERTS
    hidden = torch.randn(6, WIDTH)
    index = torch.tensor([[0, 3], [3, 3], [1, 2], [2, 0], [1, 1], [0, 2]])
    weights = torch.rand(6, 2)
    want = torch.zeros_like(hidden)
    for t in range(6):
        for j in range(2):
            e = index[t, j]
            want[t] += weights[t, j] * (F.gelu(hidden[t] @ experts.w1[e]) @ experts.w2[e])
    with torch.no_grad():
        assert torch.allclose(experts(hidden, index, weights), want, atol=1e-6)


def test_gpt_moe_counts_the_flops_of_the_experts_a_token_uses() -> None:
    """Dense gpt of the same width: the same FLOPs per token at top_k experts of 4 x n_embd
    / top_k each; more experts add parameters, not FLOPs."""
    from runner.models.gpt import GPT

    dense = GPT(64, 16, n_layer=2, n_head=2, n_embd=32)
    sparse = GPTMoE(64, 16, n_layer=2, n_head=2, n_embd=32, n_experts=8, top_k=2)
    router = 2 * 32 * 8
    assert sparse.flops_per_token() == dense.flops_per_token() + 6.0 * router
    experts = sum(p.numel() for p in sparse.blocks[0].moe.experts.parameters())
    assert experts == 8 // 2 * sum(p.numel() for p in dense.blocks[0].mlp.parameters())


# ---------------------------------------------------------------- whole runs

MOE = [
    "model=gpt_moe",
    "model.n_experts=4",
    "model.top_k=2",
    "model.aux_loss_weight=0.1",
    "model.z_loss_weight=0.01",
]


def test_top_k_above_n_experts_is_refused_before_any_rank(corpus: Path) -> None:
    found = refused(*lm_args(corpus), *MOE, "model.top_k=5")
    assert "model.top_k=5: must be between 1 and model.n_experts=4" in found


@pytest.fixture(scope="module")
def plain_moe(corpus: Path):
    """`plain_moe(*overrides)`: plain PyTorch on whole global batches, the balance losses a
    mean over the batch's sequences (one process; made once per overrides)."""
    made: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}

    def reference(*overrides: str) -> dict[str, torch.Tensor]:
        if overrides not in made:
            args = [*lm_args(corpus), *MOE, *overrides, "nproc=1"]
            spec: RunSpec = resolve_spec(compose_config(args))

            def per_sequence(model: torch.nn.Module) -> None:
                for layer in model.modules():
                    if isinstance(layer, MoE):
                        layer.state.penalty_scale = lambda: 1.0 / spec.global_batch_size

            made[overrides] = train_plain(spec, prepare=per_sequence)
        return made[overrides]

    return reference


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, corpus: Path) -> SharedRuns:
    """`moe_run(*overrides)`: one run of the module's gpt_moe with these overrides, made once
    and read by every test that asks for it."""
    return SharedRuns(tmp_path_factory.mktemp("moe_runs"), [*lm_args(corpus), *MOE])


# What the runs of the split tests below also carry, for the tests that read them: the bytes
# of expert weights each rank holds in its forward pass (test_expert_parallel_holds...), and
# checkpoints to resume from (test_a_run_resumes_at_other_expert_degrees).
HELD = (f"code_dir=[{HELPERS}]", "callbacks=[{_target_:expert_memory.ExpertBytes,ranks:all}]")
RESUMABLE = ("checkpoint.interval=2",)


def _weights(result) -> dict[str, torch.Tensor]:
    return torch.load(result.run_dir / "model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "grad_accum", "parallelism", "more"),
    [
        pytest.param(1, 4, "ddp", (), id="1x4-ddp"),
        pytest.param(2, 3, "ddp", (), id="2x3-ddp", marks=MATRIX),
        pytest.param(2, 2, "fsdp", HELD, id="2x2-fsdp"),
        pytest.param(4, 1, "fsdp", ("parallelism.tensor=2",), id="4x1-fsdp-tensor2", marks=MATRIX),
    ],
)
def test_every_split_trains_the_moe_of_plain_pytorch(
    moe_run, plain_moe, nproc: int, grad_accum: int, parallelism: str, more
) -> None:
    """Ragged, padded batches, the balance losses on: any split of the global batch over
    ranks and microbatches (and a tensor group routing its gathered sequence) trains the
    weights of one process on whole batches."""
    result = moe_run(
        f"nproc={nproc}", f"grad_accum={grad_accum}", f"parallelism={parallelism}", *more
    )
    assert relative_error(_weights(result), plain_moe()) <= 1e-5
    record = result.metrics()[-1]
    tokens = [record[f"moe/layer{i}/tokens_{s}"] for i in range(2) for s in ("min", "max")]
    assert all(t >= 0 for t in tokens) and record["moe/aux_loss"] > 0
    assert record["moe/tokens_cv"] >= 0 and record["moe/z_loss"] > 0


EP_BATCH = "global_batch_size=16"  # 2 or 4 ranks at grad_accum 1 or 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "grad_accum", "expert", "more"),
    [
        pytest.param(2, 1, 2, (), id="2x1-expert2", marks=MATRIX),
        pytest.param(2, 4, 2, (*HELD, *RESUMABLE), id="2x4-expert2"),
        # expert=4 trains in make test from a checkpoint: test_a_run_resumes_at_other_expert_
        # degrees[expert4], to the weights of 2x4-expert2, which are plain PyTorch's
        pytest.param(4, 1, 4, (), id="4x1-expert4", marks=MATRIX),
        pytest.param(
            2, 2, 2, ("activation_checkpointing=selective",), id="2x2-expert2-selective",
            marks=MATRIX,
        ),
        pytest.param(4, 4, 2, (), id="4x4-expert2-shard2", marks=MATRIX),
        pytest.param(4, 1, 2, ("parallelism.tensor=2",), id="4x1-expert2-tensor2"),
        pytest.param(
            4, 1, 2, ("parallelism.replicate=2",), id="4x1-expert2-replicate2", marks=MATRIX
        ),
        pytest.param(
            4, 2, 2, ("parallelism.pipeline=2", "data.min_length=null"),
            id="4x2-expert2-pipeline2", marks=MATRIX,
        ),
    ],
)  # fmt: skip
def test_expert_parallel_trains_the_weights_of_every_rank_holding_every_expert(
    moe_run, plain_moe, nproc: int, grad_accum: int, expert: int, more
) -> None:
    """Dropless, the balance losses on: experts split over groups of `expert` ranks, tokens
    sent to them and back by all-to-all, train the weights of one process holding every
    expert, within 1e-5 (with grad_accum, beside FSDP's shards and a pipeline's stages)."""
    data = ("data.min_length=null",) if "data.min_length=null" in more else ()
    result = moe_run(*_expert_layout(nproc, grad_accum, expert), *more)
    assert relative_error(_weights(result), plain_moe(EP_BATCH, *data)) <= 1e-5
    assert f"groups of {expert} ranks split each layer's experts" in result.rank_log(0)
    # the exchanged tokens' buffers change size every pass: mapped alone from 256 KB
    assert "heap: blocks of 256 KB or more are mapped on their own" in result.rank_log(0)


def _expert_layout(nproc: int, grad_accum: int, expert: int) -> tuple[str, ...]:
    return (
        EP_BATCH, f"nproc={nproc}", f"grad_accum={grad_accum}", "parallelism=fsdp",
        f"parallelism.expert={expert}",
    )  # fmt: skip


@pytest.mark.slow
def test_expert_parallel_holds_a_share_of_the_experts(moe_run) -> None:
    """FSDP alone gathers a layer's experts whole for its forward pass; expert parallelism
    gathers only the group's share: at expert=2, half (at most 0.55), measured in the runs
    of 2 ranks above (2x2-fsdp, 2x4-expert2)."""
    runs = {
        1: moe_run("nproc=2", "grad_accum=2", "parallelism=fsdp", *HELD),
        2: moe_run(*_expert_layout(2, 4, 2), *HELD, *RESUMABLE),
    }
    held = {
        expert: [
            json.loads((result.run_dir / f"expert_bytes_rank{r}.json").read_text())["bytes"]
            for r in range(2)
        ]
        for expert, result in runs.items()
    }
    whole = 2 * 4 * 32 * 64 * 4  # one layer's experts: 4 of them, two 32x64 fp32 weights
    assert held[1] == [whole, whole]
    assert max(held[2]) <= 0.55 * min(held[1]), held


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("nproc=1", "parallelism=ddp"), id="ddp"),
        pytest.param(("nproc=2", "parallelism=fsdp"), id="expert1", marks=MATRIX),
        pytest.param(("nproc=4", "parallelism=fsdp", "parallelism.expert=4"), id="expert4"),
    ],
)
def test_a_run_resumes_at_other_expert_degrees(moe_run, layout: tuple[str, ...]) -> None:
    """A checkpoint written with expert=2 (the 2x4-expert2 run above) holds every expert by
    its global index: it resumes under ddp on one rank, with every rank holding every
    expert, and at expert=4, to the weights of the run that never stopped."""
    first = moe_run(*_expert_layout(2, 4, 2), *HELD, *RESUMABLE)
    checkpoint = sorted((first.run_dir / "checkpoints").glob("step_*"))[0]
    step = int(checkpoint.name.split("_")[1])
    assert step < 6
    resumed = moe_run(EP_BATCH, *layout, f"resume={checkpoint}")
    assert resumed.summary()["resumed_from"] == step
    assert relative_error(_weights(resumed), _weights(first)) <= 1e-5
    if "parallelism.expert=4" in layout:
        assert "groups of 4 ranks split each layer's experts" in resumed.rank_log(0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nproc=2", "parallelism=fsdp", "parallelism.expert=4"],
         "parallelism.expert=4: must divide the shard ranks (2 = world 2"),
        (["nproc=3", "global_batch_size=12", "parallelism=fsdp", "parallelism.expert=3"],
         "parallelism.expert=3: must divide model.n_experts=4"),
        (["parallelism=ddp", "parallelism.expert=2"],
         "parallelism.expert=2: not a key of the chosen parallelism option; only of "
         "parallelism=fsdp"),
        (["parallelism=zero2", "parallelism.expert=2"],
         "parallelism.expert=2: not a key of the chosen parallelism option"),
        (["model=gpt", "nproc=2", "parallelism=fsdp", "parallelism.expert=2"],
         "parallelism.expert=2: GPT has no mixture-of-experts layer to split"),
    ],
    ids=["not-dividing-ranks", "not-dividing-experts", "ddp", "zero2", "no-experts"],
)  # fmt: skip
def test_a_bad_expert_degree_is_refused_before_any_rank(
    corpus: Path, overrides: list[str], message: str
) -> None:
    model = [] if "model=gpt" in overrides else MOE
    assert message in refused(*lm_args(corpus), *model, *overrides)


BALANCE = [
    "model=gpt_moe",
    "model.n_experts=4",
    "model.top_k=1",
    "max_steps=200",
    "log_interval=50",
    "data.min_length=24",
]


@pytest.mark.slow
def test_balancing_evens_the_experts_load(tmp_path: Path, corpus: Path) -> None:
    """After 200 steps on the same data, the spread of tokens over experts (coefficient of
    variation, per layer) with a balance loss, or with the routing bias, is below half of
    what it is without either."""
    spreads = {}
    for name, options in {
        "off": ["model.aux_loss_weight=0"],
        "aux": ["model.aux_loss_weight=0.1"],
        "bias": ["model.aux_loss_weight=0", "model.bias_update_speed=0.01"],
    }.items():
        result = run_cli(tmp_path, *lm_args(corpus), *BALANCE, *options, "nproc=1", name=name)
        assert result.returncode == 0, result.output
        spreads[name] = result.metrics()[-1]["moe/tokens_cv"]
    assert spreads["aux"] < spreads["off"] / 2, spreads
    assert spreads["bias"] < spreads["off"] / 2, spreads
