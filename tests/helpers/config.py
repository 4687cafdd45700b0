"""The config as Hydra composes it from conf/, for tests that resolve a spec in-process."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers.cli import CONF_DIR


def compose_config(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)
