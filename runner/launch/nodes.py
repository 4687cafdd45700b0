"""How the agents of a multi-node run agree before the ranks start, and stop together.

Every node's agent connects to a key-value store on master_addr:master_port,
hosted by node 0's agent (the rendezvous shares its server). Before any rank
starts:

- node 0 announces its run directory (absolute path and the run id in its
  env.json) and its resolved config;
- every other node checks that its own config agrees on every key but
  node_rank, and whether it sees node 0's directory with the same run id (a
  shared filesystem). It writes its ranks' logs there if so, into its own run
  directory if not, and tells node 0;
- node 0 starts its ranks only when every node is ready; a node that disagrees
  stops all of them, and the error names it.

During the run each agent watches the store. An agent whose ranks failed (or
that was interrupted) publishes what happened; every other agent stops its
ranks and reports the same root cause, so all runners exit non-zero within
seconds, naming the rank and the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from runner.launch import rendezvous
from runner.launch.failures import RankFailure
from runner.rundir.files import read_json

JOIN_TIMEOUT_S = 900  # how long a node waits for the others to show up
POLL_S = 0.2
# How long a failed agent waits for a better root cause from another node: only a node
# that has gone silent makes it wait this long (a busy node can take seconds to see its
# rank die; 3 s once named the consequence instead of the cause).
COLLECT_S = 10.0
LINGER_S = 5.0  # how long node 0 keeps the store up so that the others learn of a failure
REFUSAL_READ_S = 5.0  # how long node 0 keeps the store up for the others to read a refusal
LOST_S = 3.0  # a node that cannot reach node 0's store this long stops its ranks

STOP_AGREE_S = 60.0  # how long a graceful stop waits for every node's reachable step
_FAILED, _LEFT, _STOP = "runner/failed", "runner/left", "runner/stop"


class NodeMismatch(Exception):
    """The nodes cannot run together (a config differs, a node refused); nothing started."""


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks write: the run directory, and whether it is node 0's."""

    run_root: Path
    shared: bool
    nodes: list[dict[str, Any]] = field(default_factory=list)  # node 0: every node's report


@dataclass
class StopNotice:
    """Why another node's part of the run ended early: a rank's failure, or a reason
    (`node 0 on HOST was interrupted by SIGINT`, `lost contact with node 0 ...`)."""

    node_rank: int
    host: str
    failure: RankFailure | None
    reason: str = ""
    interrupted: bool = False


def config_differences(mine: dict[str, Any], theirs: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between two resolved configs (node_rank aside), as
    `key: VALUE here, VALUE on node 0`."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        if not prefix and key == "node_rank":
            continue
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} here, {b!r} on node 0")
    return out


class StoreValueError(ValueError):
    """A store key holds something runner did not write there."""


def decode(key: str, raw: bytes) -> Any:
    """A value another node wrote: JSON (data, never code), or a clear error."""
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        text = raw[:60].decode(errors="replace")
        raise StoreValueError(
            f"the store's key {key!r} holds {text!r}, which runner did not write: is another "
            "program using master_port?"
        ) from None


def stop_notice(key: str, data: Any) -> StopNotice:
    try:
        failure = data.get("failure")
        return StopNotice(
            int(data["node_rank"]),
            str(data["host"]),
            RankFailure.from_dict(failure) if failure else None,
            str(data.get("reason", "")),
            bool(data.get("interrupted", False)),
        )
    except (AttributeError, KeyError, TypeError, ValueError):
        raise StoreValueError(
            f"the store's key {key!r} holds {str(data)[:60]!r}, not a node's stop notice"
        ) from None


class NodeLink:
    """This agent's connection to the others (see the module docstring)."""

    def __init__(self, addr: str, port: int, node_rank: int, nodes: int):
        self.addr, self.port, self.node_rank, self.nodes = addr, port, node_rank, nodes
        self.host = socket.gethostname()
        self.store = self._connect(serve=node_rank == 0)
        self._stop = threading.Event()
        self.notices: list[StopNotice] = []  # set by the watcher before it signals the agent
        self._on_stop_asked: Callable[[str], None] | None = None
        self._left = False

    def _connect(self, timeout: float = JOIN_TIMEOUT_S, serve: bool = False):
        """A connection to node 0's store; `serve`: node 0 starts that store first."""
        from torch.distributed import TCPStore

        wait = timedelta(seconds=timeout)
        if serve:  # on master_addr only; node 0's rendezvous reuses it
            return rendezvous.serve_store(self.addr, self.port, self.nodes, wait)
        return TCPStore(self.addr, self.port, self.nodes, False, wait, wait_for_workers=False)

    def _set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> Any:
        return decode(key, self.store.get(key))

    # --- before the ranks start -------------------------------------------------------

    def agree(self, run_root: Path, config_text: str) -> Placement:
        """Node 0: announce and wait for every node. Others: check, report, and place."""
        if self.node_rank == 0:
            return self._lead(run_root, config_text)
        return self._follow(run_root, config_text)

    def _lead(self, run_root: Path, config_text: str) -> Placement:
        env = read_json(run_root / "env.json") or {}
        self._set(
            "runner/run",
            {"dir": str(run_root.resolve()), "run_id": env.get("run_id"), "config": config_text},
        )
        reports = [self._get(f"runner/node{i}") for i in range(1, self.nodes)]
        refused = [
            f"node {r['node_rank']} on {r['host']}: {r['error']}" for r in reports if r["error"]
        ]
        self._set("runner/start", {"ok": not refused})
        if refused:  # keep the store up until every node has read that (or a short while)
            seen = [f"runner/seen{i}" for i in range(1, self.nodes)]
            with contextlib.suppress(Exception):
                self.store.wait(seen, timedelta(seconds=REFUSAL_READ_S))
            raise NodeMismatch("; ".join(refused))
        me = {"node_rank": 0, "host": self.host, "dir": str(run_root.resolve()), "shared": True}
        return Placement(run_root, True, [me, *reports])

    def _follow(self, local_root: Path, config_text: str) -> Placement:
        lead = self._get("runner/run")
        problems = config_differences(yaml.safe_load(config_text), yaml.safe_load(lead["config"]))
        error = (
            "its configuration differs from node 0's: " + "; ".join(problems) if problems else None
        )
        lead_dir = Path(lead["dir"])
        lead_env = read_json(lead_dir / "env.json") or {}
        shared = lead["run_id"] is not None and lead_env.get("run_id") == lead["run_id"]
        root = lead_dir if shared else local_root
        report = {
            "node_rank": self.node_rank,
            "host": self.host,
            "dir": str(root.resolve()),
            "shared": shared,
            "error": error,
        }
        self._set(f"runner/node{self.node_rank}", report)
        if error:  # this node refuses: node 0's verdict can only agree
            self._set(f"runner/seen{self.node_rank}", True)
            raise NodeMismatch(f"node {self.node_rank} on {self.host}: {error}")
        start = self._get("runner/start")
        self._set(f"runner/seen{self.node_rank}", True)
        if not start["ok"]:
            raise NodeMismatch("another node refused to start; see node 0's output")
        return Placement(root, shared)

    # --- while the ranks run ----------------------------------------------------------

    def watch(self, on_stop_asked: Callable[[str], None] | None = None) -> None:
        """Stop this agent (SIGTERM to itself) when another node's part of the run ends early;
        call `on_stop_asked(why)` when another node asks for a graceful stop."""
        self._on_stop_asked = on_stop_asked
        threading.Thread(target=self._watch, name="runner-node-watch", daemon=True).start()

    def _watch(self) -> None:
        client, lost_since, asked = None, None, False
        while not self._stop.wait(POLL_S):
            try:
                client = client or self._connect(timeout=LOST_S)
                count = client.add(_FAILED, 0)
                if not asked and self._on_stop_asked is not None and client.add(_STOP, 0):
                    asked = True
                    self._on_stop_asked(self._stop_asker(client))
                lost_since = None
            except Exception:  # node 0's agent (the store's host) is gone or unreachable
                client = None
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since < LOST_S or self._stop.is_set():
                    continue
                reason = f"lost contact with node 0's agent at {self.addr}:{self.port}"
                self.notices = [StopNotice(0, self.addr, None, reason)]
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if count:
                notices = self._others_notices(client)
                if notices and not self._stop.is_set():
                    self.notices = notices
                    self._leave(client)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    def stop_watching(self) -> None:
        self._stop.set()

    # --- a graceful stop (runner.launch.stopping) -------------------------------------

    def agree_stop(self, reachable: int, asked_by: str) -> int:
        """Publish this node's reachable step (and so the request: the other nodes' watchers
        see it), wait for every node's, and return the largest: the step all ranks stop after.
        Its own connection: the watcher's and the main thread's may be busy."""
        store = self._connect(timeout=STOP_AGREE_S)
        mine = {"step": reachable, "asked_by": asked_by, "host": self.host}
        store.set(f"{_STOP}/node{self.node_rank}", json.dumps(mine))
        store.add(_STOP, 1)
        keys = [f"{_STOP}/node{i}" for i in range(self.nodes)]
        store.wait(keys, timedelta(seconds=STOP_AGREE_S))
        return max(int(decode(key, store.get(key))["step"]) for key in keys)

    def _stop_asker(self, store: Any) -> str:
        """Who asked for the graceful stop: `SIGUSR1 on node 0 (host)`."""
        for i in range(self.nodes):
            key = f"{_STOP}/node{i}"
            if i != self.node_rank and store.check([key]):
                data = decode(key, store.get(key))
                return f"{data.get('asked_by')} on node {i} ({data.get('host')})"
        return "another node"

    def _others_notices(self, store: Any = None) -> list[StopNotice]:
        """What the other nodes have published so far."""
        store = store or self.store
        notices = []
        for i in range(self.nodes):
            key = f"{_FAILED}/node{i}"
            if i == self.node_rank:
                continue
            if store.check([key]):
                notices.append(stop_notice(key, decode(key, store.get(key))))
        return notices

    # --- when this node's part ends early ---------------------------------------------

    def publish(self, failure: RankFailure | None, signal_name: str | None = None) -> None:
        """Tell the other nodes that this node's ranks failed, or that it got `signal_name`."""
        self.stop_watching()
        reason = f"node {self.node_rank} on {self.host} was interrupted by {signal_name}"
        data = {
            "node_rank": self.node_rank,
            "host": self.host,
            "failure": failure.as_dict() if failure else None,
            "reason": "" if failure else reason,
            "interrupted": failure is None,
        }
        with contextlib.suppress(Exception):  # node 0's agent is gone: the others learn
            self._set(f"{_FAILED}/node{self.node_rank}", data)  # of it from their ranks
            self.store.add(_FAILED, 1)

    def remote_failures(self, wait_s: float) -> list[RankFailure]:
        """Failures other nodes published, waiting up to `wait_s` for the first one or for
        every other node to have said how it ended. A node other than 0 is done with the
        store afterwards."""
        deadline = time.monotonic() + wait_s
        failures: list[RankFailure] = []
        while not self._left:
            try:
                notices = self._others_notices()
            except Exception:  # node 0's agent is gone
                break
            failures = [n.failure for n in notices if n.failure is not None]
            everyone = len(notices) == self.nodes - 1
            if failures or everyone or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        self._leave(self.store)
        return failures

    def _leave(self, store: Any) -> None:
        """Tell node 0 that this node no longer needs its store (once)."""
        if self.node_rank == 0 or self._left:
            return
        self._left = True
        with contextlib.suppress(Exception):  # node 0's agent is already gone
            store.add(_LEFT, 1)

    def linger(self) -> None:
        """Node 0 hosts the store: after a failure, keep it up until every other node has
        read the news and left (or LINGER_S passed)."""
        if self.node_rank != 0:
            return
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            if self.store.add(_LEFT, 0) >= self.nodes - 1:
                return
            time.sleep(POLL_S)
