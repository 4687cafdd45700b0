"""The run spec: schema, conversion from config data, and the checks between fields."""

from runner.spec import resolvers
from runner.spec.config_file import load_spec, save_spec
from runner.spec.convert import SpecError, from_dict, to_dict
from runner.spec.resolve import resolve_spec
from runner.spec.schema import Precision, RunSpec, SyncStrategy

resolvers.register()

__all__ = [
    "Precision",
    "RunSpec",
    "SpecError",
    "SyncStrategy",
    "from_dict",
    "load_spec",
    "resolve_spec",
    "save_spec",
    "to_dict",
]
