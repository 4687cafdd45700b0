"""runner's OmegaConf resolvers, for values a config file cannot spell out portably.

${runner_python_stdlib:}   the directory of Python's own standard library sources:
                           text every Python install has (recipe gpt_text trains on it)
"""

from __future__ import annotations

import sysconfig

from omegaconf import OmegaConf


def register() -> None:
    OmegaConf.register_new_resolver(
        "runner_python_stdlib", lambda: sysconfig.get_paths()["stdlib"], replace=True
    )
