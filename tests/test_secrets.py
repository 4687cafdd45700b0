"""Secrets stay secret: a value from the environment stays a placeholder, a secret-named
key's literal value is masked, in every file of the run (and sweep) directory, the MLflow
store and submitit's folder (its pickles of the jobs), while the ranks get the real
values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runner.secrets import (
    MASK,
    Secrets,
    hide_literal_secrets,
    is_secret_key,
    masked_problems,
    restore,
)
from tests.helpers.cli import FAST, HANG, child_env, runner_command

FAKE_TOKEN = "hf_FAKE0token0for0tests0123456789"
FAKE_KEY = "sk-FAKE0api0key0987654321"

DATA = '''
import os
from runner.data.digits import digits


def digits_with_secrets(hf_token: str, api_key: str, val_fraction: float = 0.2):
    """Checks that the ranks got the real values (the agent's check too)."""
    if hf_token != os.environ["FAKE_TOKEN"] or api_key != os.environ["EXPECTED_KEY"]:
        raise ValueError("the secrets did not arrive")
    return digits(val_fraction=val_fraction)
'''


@pytest.mark.slow
@pytest.mark.sweeps
def test_no_file_of_a_submitit_sweep_or_its_mlflow_store_holds_a_secret(tmp_path: Path) -> None:
    (tmp_path / "mydata.py").write_text(DATA)
    store = tmp_path / "store"
    env = {
        **child_env(),
        "FAKE_TOKEN": FAKE_TOKEN,
        "EXPECTED_KEY": FAKE_KEY,
        "SECRET_URI": f"sqlite:///{store}/mlflow.db",
    }
    store.mkdir()
    root = tmp_path / "sweep"
    proc = subprocess.run(
        runner_command(
            "-m",
            "hydra/launcher=submitit_local",  # pickles each job into the sweep's .submitit/
            *FAST,
            "max_steps=2",
            "seed=0,1",
            "data=custom",
            "data._target_=mydata.digits_with_secrets",
            "+data.hf_token=${oc.env:FAKE_TOKEN}",
            f"+data.api_key={FAKE_KEY}",
            "logger=[mlflow,csv,tensorboard]",
            "logger.mlflow.tracking_uri=${oc.env:SECRET_URI}",
            f"hydra.sweep.dir={root}",
        ),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert FAKE_TOKEN not in proc.stdout + proc.stderr and FAKE_KEY not in proc.stderr

    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "mydata.py"]
    assert any(p.suffix == ".db" for p in written) and (root / "sweep.csv").is_file()
    assert any(p.suffix == ".pkl" for p in (root / ".submitit").rglob("*"))
    for path in written:
        content = path.read_bytes()
        for secret in (FAKE_TOKEN, FAKE_KEY, str(store)):
            assert (
                secret.encode() not in content or path.name == "mlflow.db" and secret == str(store)
            ), f"{secret} in {path}"
    config = (root / "0" / "config.yaml").read_text()
    assert "${oc.env:FAKE_TOKEN}" in config and "${oc.env:SECRET_URI}" in config
    assert f"api_key: '{MASK}'" in config
    argv = (root / "0" / "env.json").read_text()
    assert f"+data.api_key={MASK}" in argv


def test_placeholders_stay_and_secret_values_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("T", "real")
    unresolved = {"data": {"token": "${oc.env:T}", "key_secret": "abc12345", "n": 3}, "x": "y"}
    resolved = {"data": {"token": "real", "key_secret": "abc12345", "n": 3}, "x": "y"}
    secrets = Secrets.of(unresolved, resolved)
    assert secrets.placeholders == {"data.token": "${oc.env:T}"}
    assert secrets.values == {"data.key_secret": "abc12345"}
    written = secrets.written(resolved)
    assert written == {"data": {"token": "${oc.env:T}", "key_secret": MASK, "n": 3}, "x": "y"}
    assert secrets.masked_argv(["+data.key_secret=abc12345", "n=3"]) == [
        f"+data.key_secret={MASK}",
        "n=3",
    ]
    environ = {"RUNNER_SECRETS": secrets.environment()}
    assert restore(written, environ) == resolved
    assert masked_problems(written) == [
        f"data.key_secret={MASK}: the earlier run's config.yaml masks this secret; give it "
        "again (data.key_secret=...) or from the environment (data.key_secret='${oc.env:NAME}')"
    ]
    names = ["hf_token", "token", "db_password", "openai_api_key", "clientSecret", "secret_key",
             "tokenizer", "max_tokens", "token_dtype", "pad_token", "tokens_per_step"]  # fmt: skip
    secret = ["hf_token", "token", "db_password", "openai_api_key", "clientSecret", "secret_key"]
    assert [k for k in names if is_secret_key(k)] == secret


def test_a_literal_secret_on_the_command_line_reaches_hydra_as_a_reference() -> None:
    environ: dict[str, str] = {}
    args = ["+data.api_key=sk-123", "data.hf_token='a b'", "hf_token=null", "lr=0.1", "-m"]
    hidden = hide_literal_secrets([*args, "db_password=a,b"], environ)
    assert hidden == [
        "+data.api_key=${oc.env:RUNNER_SECRET_DATA_API_KEY}",
        "data.hf_token=${oc.env:RUNNER_SECRET_DATA_HF_TOKEN}",
        "hf_token=null",  # a value Hydra reads as None, no secret
        "lr=0.1",
        "-m",
        "db_password=a,b",  # a sweep over secrets stays as it is
    ]
    assert environ == {"RUNNER_SECRET_DATA_API_KEY": "sk-123", "RUNNER_SECRET_DATA_HF_TOKEN": "a b"}
    # the reference counts as the literal: masked in config.yaml, handed down to the ranks
    unresolved = {"data": {"api_key": "${oc.env:RUNNER_SECRET_DATA_API_KEY}"}}
    secrets = Secrets.of(unresolved, {"data": {"api_key": "sk-123"}})
    assert secrets.values == {"data.api_key": "sk-123"} and not secrets.placeholders
    assert secrets.written({"data": {"api_key": "sk-123"}}) == {"data": {"api_key": MASK}}
    assert secrets.masked_argv(hidden[:1]) == [f"+data.api_key={MASK}"]
