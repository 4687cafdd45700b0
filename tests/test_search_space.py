"""hydra/sweeper=runner reads its search space with Hydra's public override grammar: each
sweep override means the distribution Hydra's Optuna sweeper gives it (checked against that
plugin's own reading), so a study kept by either goes on under the other."""

from __future__ import annotations

from runner.sweeps.search_space import search_space

OVERRIDES = [
    "optimizer.lr=tag(log,interval(1e-4,1e-1))",
    "warmup=interval(0,5)",
    "width=tag(log,interval(8,64))",
    "grad_accum=range(1,5)",
    "dropout=range(0.0,0.5,0.1)",
    "parallelism=choice(ddp,zero2)",
    "seed=1,2,3",
    "nproc=2",
    "model=mlp",
]


def test_each_override_means_what_hydras_optuna_sweeper_reads() -> None:
    # imported here: Optuna costs seconds, and every worker of the suite collects this module
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    searched, fixed = search_space(OVERRIDES)
    theirs, their_fixed = create_params_from_overrides(OVERRIDES)
    assert searched == theirs
    assert [type(d) for d in searched.values()] == [type(d) for d in theirs.values()]
    assert fixed == their_fixed == {"nproc": "2", "model": "mlp"}
    assert searched["seed"].choices == (1, 2, 3)


def test_a_shuffled_range_is_a_choice_of_its_values() -> None:
    searched, _ = search_space(["seed=shuffle(range(1,4))"])
    assert sorted(searched["seed"].choices) == [1, 2, 3]
