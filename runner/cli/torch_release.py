"""The torch releases runner supports, checked before anything starts.

GPU machines bring their own torch (an NGC container's, a cloud image's, built for their
CUDA) and often cannot install another, so runner runs on every torch from `FLOOR` on and
finds out what a release can do by feature detection, never by its number. The floor is
the oldest release CI tests (`make test-floor`); pyproject.toml declares the same one.

Read from the installed package's metadata: the parent never imports torch (seconds).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

FLOOR = (2, 11)
NEWEST_TESTED = (2, 15)


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string: '2.11.0+cu130', '2.12.0a0+git1f6f5ee' (an NGC
    build of a release still in development counts as that release)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def problem(installed: str | None) -> str | None:
    """The line to exit with for this installed torch version (None: none installed), or
    None where it is supported."""
    supported = f"runner supports torch {FLOOR[0]}.{FLOOR[1]} and newer"
    tested = f"tested {FLOOR[0]}.{FLOOR[1]} to {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}"
    if installed is None:
        return f"runner: torch is not installed; {supported} ({tested})"
    release = _release(installed)
    if release is not None and release < FLOOR:
        return (
            f"runner: torch {installed} is installed; {supported} ({tested}): "
            f"install a newer one, e.g. pip install 'torch>={FLOOR[0]}.{FLOOR[1]}'"
        )
    return None


def check() -> None:
    """Exit with one line (status 2) when this environment's torch is older than the
    floor, or missing."""
    try:
        installed: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        installed = None
    line = problem(installed)
    if line is not None:
        print(line, file=sys.stderr)
        sys.exit(2)
