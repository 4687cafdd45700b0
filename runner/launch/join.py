"""Meeting the other nodes of a multi-node run before any rank starts: the link between the
agents (runner.launch.nodes), the network interface towards node 0, and where this node's
ranks write (node 0's run directory when the filesystem is shared)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from runner.errors import first_line
from runner.launch import network, nodes
from runner.rundir.files import RunDir, read_json, write_json
from runner.spec import RunSpec

log = logging.getLogger("runner")


def join_nodes(spec: RunSpec, node_dir: Path, run_root: Path) -> tuple[nodes.NodeLink, Path]:
    """Meet the other nodes (see launch.nodes); returns the link and where the ranks write."""
    assert spec.master_port is not None, "multi-node runs have a fixed master_port"
    if spec.node_rank > 0:
        log.info(
            "runner: node %d of %d: waiting for node 0 at %s:%d",
            spec.node_rank,
            spec.nodes,
            spec.master_addr,
            spec.master_port,
        )
    else:
        log.info(
            "runner: node 0 of %d: waiting for the other nodes on port %d",
            spec.nodes,
            spec.master_port,
        )
    try:
        link = nodes.NodeLink(spec.master_addr, spec.master_port, spec.node_rank, spec.nodes)
    except Exception as exc:  # cannot bind (node 0) or reach node 0 (the others)
        what = "listen on" if spec.node_rank == 0 else "reach node 0 at"
        raise nodes.NodeMismatch(
            f"node {spec.node_rank} cannot {what} {spec.master_addr}:{spec.master_port}: "
            + (first_line(exc) or type(exc).__name__)
        ) from None
    try:
        placement = link.agree(run_root, (node_dir / "config.yaml").read_text())
    except nodes.NodeMismatch:
        raise
    except Exception as exc:  # a node never came, or went away while the nodes met
        raise nodes.NodeMismatch(
            f"node {spec.node_rank}: the {spec.nodes} nodes did not all meet within "
            f"{nodes.JOIN_TIMEOUT_S} s on {spec.master_addr}:{spec.master_port}: "
            + (first_line(exc) or type(exc).__name__)
        ) from None
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # see runner.launch.network
        interface = network.interface_towards(spec.master_addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if spec.node_rank == 0:
        env_path = RunDir(run_root).env
        env = read_json(env_path) or {}
        env["hosts"] = list(dict.fromkeys(n["host"] for n in placement.nodes))
        env["nodes"] = placement.nodes
        write_json(env_path, env)
    elif not placement.shared:
        log.warning(
            "runner: node %d does not see node 0's run directory; its ranks write to %s "
            "(checkpoints and resume need a shared filesystem)",
            spec.node_rank,
            placement.run_root,
        )
    return link, placement.run_root
