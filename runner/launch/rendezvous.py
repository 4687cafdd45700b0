"""runner's rendezvous backend for torch elastic: static membership, a fresh store per attempt.

Membership is fixed (nodes, node_rank, master_addr, master_port), like torch's
"static" backend, with two differences that matter to runner:

- The port may be 0 on a single node: the OS picks a free one, so runs on one
  machine never clash, and the ranks are told the real port.
- Every attempt (the first start and each restart after a failure) gets a new,
  empty key-value store for its ranks. torch's static backend hands every
  attempt the same store, so restarted ranks read the previous attempt's gloo
  addresses and fail to connect ("Connection refused").

The store on master_port lives as long as the agents and only tells the other
nodes where each attempt's store listens. Every store listens on master_addr's address
only (127.0.0.1 on a single node), not on every interface: the stores are unauthenticated.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from runner.launch import network

BACKEND = "runner-static"


def serve_store(addr: str, port: int, nodes: int, timeout: timedelta) -> Any:
    """A TCPStore server on `addr` only (port 0: the OS picks one); shared by every store
    of this process on the same port (multi_tenant)."""
    from torch.distributed import TCPStore

    fd, bound = network.listening_socket(addr, port)
    return TCPStore(
        addr,
        bound,
        nodes,
        True,
        timeout,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=fd,
    )


def parse_port(key: str, raw: bytes) -> int:
    """A port another agent published; anything else is a clear error, not a traceback."""
    text = raw.decode(errors="replace").strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RuntimeError(
            f"the rendezvous store's key {key!r} holds {text[:40]!r}, not a port: is another "
            "program using master_port?"
        )
    return int(text)


class StaticFreshStore:
    """The handler's behaviour (torch elastic's RendezvousHandler interface); `register` makes
    it a RendezvousHandler once torch is imported, so this module imports no torch itself."""

    def __init__(self, addr: str, port: int, rank: int, nodes: int, run_id: str, timeout: int):
        self.addr, self.port, self.rank, self.nodes = addr, port, rank, nodes
        self.run_id = run_id
        self.timeout = timedelta(seconds=timeout)
        self._base: Any = None
        self._attempt_store: Any = None
        self._round = 0

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def _base_store(self) -> Any:
        from torch.distributed import TCPStore

        if self._base is None and self.rank == 0 and self.nodes > 1:
            # node 0's NodeLink already serves this port (runner.launch.nodes): reuse it
            self._base = TCPStore(
                self.addr, self.port, self.nodes, True, self.timeout, multi_tenant=True
            )
        elif self._base is None and self.rank == 0:
            self._base = serve_store(self.addr, self.port, self.nodes, self.timeout)
        elif self._base is None:
            self._base = TCPStore(self.addr, self.port, self.nodes, False, self.timeout)
        return self._base

    def next_rendezvous(self) -> Any:
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

        base = self._base_store()
        self._round += 1
        key = f"{self.run_id}/round{self._round}/port"
        if self.rank == 0:
            store = serve_store(self.addr, 0, self.nodes, self.timeout)
            base.set(key, str(store.port))
        else:
            port = parse_port(key, base.get(key))
            store = TCPStore(self.addr, port, self.nodes, False, self.timeout)
        self._attempt_store = store  # the previous attempt's store is released
        return RendezvousInfo(
            PrefixStore(self.run_id, store),
            self.rank,
            self.nodes,
            RendezvousStoreInfo(self.addr, store.port),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def register() -> None:
    """Make the backend available to torch elastic's rendezvous registry."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousParameters,
        registry,
    )
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    handler = type(
        "StaticFreshStoreRendezvous",
        (StaticFreshStore, RendezvousHandler),
        {"__module__": __name__},
    )

    def create(params: RendezvousParameters) -> RendezvousHandler:
        addr, port = parse_rendezvous_endpoint(params.endpoint, -1)
        if port < 0:
            raise ValueError(f"rendezvous endpoint {params.endpoint!r} has no port")
        rank, timeout = int(params.config["rank"]), int(params.config.get("timeout", 900))
        return handler(addr, port, rank, params.max_nodes, params.run_id, timeout)

    with contextlib.suppress(ValueError):  # already registered in this process
        registry.handler_registry.register(BACKEND, create)
