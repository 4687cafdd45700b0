"""runner's own conf/ directory and what its option files hold."""

from __future__ import annotations

from pathlib import Path

import yaml


def conf_dir() -> str:
    """conf/ inside the installed package, or beside it in a checkout."""
    package = Path(__file__).resolve().parents[1]  # runner/
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise SystemExit(f"runner: cannot find conf/config.yaml next to {package}; reinstall runner")


def option_keys(group: str) -> set[str]:
    """The top-level keys of every option file of `group` (a component's arguments)."""
    keys: set[str] = set()
    for path in (Path(conf_dir()) / group).glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict):
            keys |= {str(k) for k in data if not str(k).startswith("_")}
    return keys
