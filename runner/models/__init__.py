"""Built-in models, shaped for the data (builders), and the names and shapes of a model's
state (shapes), which a resume checkpoint must match."""

from runner.models.builders import build_model

__all__ = ["build_model"]
