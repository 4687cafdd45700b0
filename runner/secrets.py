"""Secrets stay out of the run directory, the logs and the trackers.

Two kinds of value are kept out of everything runner writes or logs:

- a value that comes from the environment (`${oc.env:NAME}` anywhere in it): config.yaml
  keeps the placeholder, and each process resolves it from its own environment when it
  reads the config (`restore`), as a rank on another node does from that node's;
- a value given literally to a key whose name marks a secret (`password`, `api_key` or
  `secret` in it, or ending in `token`: `hf_token`, `db_password`; not `token_dtype`):
  config.yaml, env.json's argv and Hydra's own files hold `***` in its place; the parent
  hands the values to the agent and the ranks in their environment (SECRETS_ENV), never
  in a file.

A literal secret given on the command line never reaches Hydra as such: the parent moves it
into its own environment (RUNNER_SECRET_<KEY>) and hands Hydra a reference to it
(`hide_literal_secrets`), so what Hydra keeps and what launcher plugins pickle (submitit's
jobs and their results) hold the reference only; the reference counts as the literal it
stands for, masked wherever it would be written.

A run started again from its config.yaml (`runner rerun`, `runner eval`) gets placeholders
back as written and must be given the masked values again: a `***` left is refused.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SECRET_PARTS = {"password", "passwd", "secret", "apikey"}  # anywhere in the key's name
# `..._token` is a secret (hf_token, access_token) unless it names a tokenizer's token
SPECIAL_TOKENS = {"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "special"}
MASK = "***"
ENV_REFERENCE = "${oc.env:"
SECRETS_ENV = "RUNNER_SECRETS"  # the masked values, as JSON, for the agent and the ranks
HIDDEN_PREFIX = "RUNNER_SECRET_"  # a command line's literal secret, moved to the environment
_HIDDEN = re.compile(r"\$\{oc\.env:" + HIDDEN_PREFIX + r"[A-Z0-9_]+\}")
_PLAIN_VALUE = re.compile(r"[^,\[\]{}()$'\"\s]+")  # one value: not a sweep, list or reference
_QUOTED_VALUE = re.compile(r"[^$'\"]+")


def is_secret_key(key: str) -> bool:
    """A key whose name marks a secret: `hf_token`, `token`, `db_password`, `api_key`,
    `client_secret`; not `tokenizer`, `max_tokens`, `token_dtype` or `pad_token`."""
    leaf = key.rsplit(".", 1)[-1].replace("-", "_")
    leaf = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", leaf).lower().replace("api_key", "apikey")
    parts = leaf.split("_")
    if SECRET_PARTS & set(parts):
        return True
    return parts[-1] == "token" and not (len(parts) > 1 and parts[-2] in SPECIAL_TOKENS)


def _walk(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; list items as `key.0`, `key.1`."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, Sequence) and not isinstance(node, str):
        for i, value in enumerate(node):
            yield from _walk(value, f"{prefix}.{i}")
    else:
        yield prefix, node


def _set(node: Any, key: str, value: Any) -> bool:
    """Set dotted `key` in the nested dicts and lists of `node`; False where it is not."""
    *parents, leaf = key.split(".")
    for part in parents:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    if isinstance(node, dict) and leaf in node:
        node[leaf] = value
        return True
    if isinstance(node, list) and leaf.isdigit() and int(leaf) < len(node):
        node[int(leaf)] = value
        return True
    return False


@dataclass
class Secrets:
    """What of a run's config must not be written as it resolved."""

    placeholders: dict[str, str] = field(default_factory=dict)  # key -> "${oc.env:...}"
    values: dict[str, Any] = field(default_factory=dict)  # secret-named key -> its value

    @classmethod
    def of(cls, unresolved: Any, resolved: Any) -> Secrets:
        """From the composed config before and after its interpolations were resolved."""
        raw = dict(_walk(unresolved))
        found = cls()
        for key, value in _walk(resolved):
            written = raw.get(key)
            if isinstance(written, str) and _HIDDEN.fullmatch(written):  # a literal, hidden
                found.values[key] = value
            elif isinstance(written, str) and ENV_REFERENCE in written:
                found.placeholders[key] = written
            elif is_secret_key(key) and value not in (None, "", MASK):
                found.values[key] = value
        return found

    def written(self, config: Any) -> Any:
        """A copy of the plain `config` (its dotted keys the composed config's) as it may be
        written: placeholders as written, secret values masked."""
        copy = json.loads(json.dumps(config, default=str))
        for key, placeholder in self.placeholders.items():
            _set(copy, key, placeholder)
        for key in self.values:
            _set(copy, key, MASK)
        return copy

    def scrub(self, text: str) -> str:
        """`text` with each secret value (as text, 4 characters or more) masked."""
        text = _HIDDEN.sub(MASK, text)
        for value in sorted({str(v) for v in self.values.values()}, key=len, reverse=True):
            if len(value) >= 4:
                text = text.replace(value, MASK)
        return text

    def masked_argv(self, argv: Sequence[str]) -> list[str]:
        """A command line with each secret value masked."""
        return [self.scrub(arg) for arg in argv]

    def environment(self) -> str:
        return json.dumps(self.values)


def hide_literal_secrets(args: Sequence[str], environ: MutableMapping[str, str]) -> list[str]:
    """The command line's overrides with each literal value of a secret-named key moved into
    `environ` and referenced there: `+data.api_key=VALUE` becomes
    `+data.api_key=${oc.env:RUNNER_SECRET_DATA_API_KEY}`."""
    hidden = []
    for arg in args:
        key, equals, value = arg.partition("=")
        name = key.lstrip("+")
        quoted = len(value) > 1 and value[0] == value[-1] and value[0] in "'\""
        if quoted:
            value = value[1:-1]  # the value inside
        if (
            equals
            and not arg.startswith(("-", "~"))
            and is_secret_key(name)
            and value.lower() not in (MASK, "null", "true", "false")
            and (_PLAIN_VALUE if not quoted else _QUOTED_VALUE).fullmatch(value)
        ):
            variable = HIDDEN_PREFIX + re.sub(r"[^A-Z0-9]", "_", name.upper())
            environ[variable] = value
            arg = f"{key}=${{oc.env:{variable}}}"
        hidden.append(arg)
    return hidden


def restore(config: Any, environ: Mapping[str, str]) -> Any:
    """config.yaml's data as the run resolved it: each `${oc.env:...}` placeholder resolved
    from `environ`, each `***` from the values the parent handed down (SECRETS_ENV)."""
    values = json.loads(environ.get(SECRETS_ENV) or "{}")
    config = copy.deepcopy(config)
    for key, value in list(_walk(config)):
        if isinstance(value, str) and ENV_REFERENCE in value:
            _set(config, key, resolve_placeholder(key, value))
        elif value == MASK and key in values:
            _set(config, key, values[key])
    return config


def resolve_placeholder(key: str, text: str) -> Any:
    """`text` resolved by OmegaConf as Hydra resolved it in the parent, from this process's
    environment."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create({"value": text}), resolve=True)["value"]
    except OmegaConfBaseException as exc:
        reason = str(exc).strip().splitlines()[0]
        raise ValueError(f"{key}={text}: {reason} (in this process's environment)") from None


def mask_secret_keys(config: Any) -> Any:
    """A copy of `config` with the value of each secret-named key masked (what a rank writes
    of its resolved spec beyond config.yaml: a checkpoint's record of the data's arguments)."""
    copy_ = copy.deepcopy(config)
    for key, value in list(_walk(copy_)):
        if is_secret_key(key) and value not in (None, ""):
            _set(copy_, key, MASK)
    return copy_


def masked_problems(config: Any) -> list[str]:
    """Secret-named keys that still hold `***` (a config written by an earlier run)."""
    return [
        f"{key}={MASK}: the earlier run's config.yaml masks this secret; give it again "
        f"({key}=...) or from the environment ({key}='${{oc.env:NAME}}')"
        for key, value in _walk(config)
        if value == MASK and is_secret_key(key)
    ]
