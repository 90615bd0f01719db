"""Ranks started by a launcher (torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) rather than
spawned by rank 0, so that the ranks may sit on several hosts (docs/decisions/multi-gpu.md, "Launched ranks").

Every rank runs the user's script. Rank 0's `LLM(...)` is the engine; on every other rank `LLM(...)` serves rank 0
until it closes, then ends the process. The ranks meet through torch.distributed's env:// rendezvous; its store
carries rank 0's control address and a token, and each worker opens three connections to it (its two lanes' calls,
its reports), the same `Connection`s that spawned workers are handed, so the serving code is one.
"""
import dataclasses
import json
import os
import secrets
import socket
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from offload_engine.distributed import parallel_state

CONTROL_KEY = "offload-engine/control"  # rank 0's address and token, in the rendezvous store
PURPOSES = (*parallel_state.LANES, "report")  # a worker's connections to rank 0, opened in this order
HELLO_TIMEOUT = 30.0  # for a connected worker to say who it is


@dataclasses.dataclass(frozen=True)
class Launch:
    rank: int
    size: int
    local_rank: int
    master_addr: str


def launched_rank(tensor_parallel_size: int) -> Launch | None:
    """This process's place among launched ranks; None where no launcher set RANK and WORLD_SIZE or the engine is
    not tensor-parallel (rank 0 then spawns its workers). A world of another size is a ValueError."""
    if tensor_parallel_size == 1 or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    size = int(os.environ["WORLD_SIZE"])
    if size != tensor_parallel_size:
        raise ValueError(f"the launcher started {size} processes (WORLD_SIZE) but tensor_parallel_size is "
                         f"{tensor_parallel_size}: start one process per rank (torchrun --nproc-per-node "
                         f"{tensor_parallel_size} on one host)")
    return Launch(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", 0)),
                  os.environ.get("MASTER_ADDR", "127.0.0.1"))


def rendezvous_store(launch: Launch, timeout: float) -> dist.Store:
    """The launcher's store (env://: MASTER_ADDR and MASTER_PORT, or torchrun's agent's)."""
    store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.size,
                                       timeout=timedelta(seconds=timeout)))
    return store


class ControlServer:
    """Rank 0's end: listens on every interface, publishes MASTER_ADDR:port and a token in the store, and takes
    each worker's three connections."""

    def __init__(self, launch: Launch, store: dist.Store):
        self.launch, self.token = launch, secrets.token_hex(16)
        self.server = socket.create_server(("", 0))
        port = self.server.getsockname()[1]
        store.set(CONTROL_KEY, json.dumps({"host": launch.master_addr, "port": port, "token": self.token}))

    def accept(self, timeout: float) -> dict[int, dict[str, Connection]]:
        """{rank: {purpose: connection}} once every worker has opened all of its; TimeoutError past `timeout` s."""
        wanted = (self.launch.size - 1) * len(PURPOSES)
        found: dict[int, dict[str, Connection]] = {}
        deadline = time.monotonic() + timeout
        while sum(len(conns) for conns in found.values()) < wanted:
            self.server.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = self.server.accept()
            except socket.timeout:
                raise TimeoutError(f"{wanted - sum(map(len, found.values()))} of the launched ranks' connections did "
                                   f"not reach rank 0 within {timeout:.0f} s") from None
            sock.settimeout(None)
            conn = Connection(sock.detach())
            hello = _hello(conn)
            if hello is None or hello.get("token") != self.token or hello.get("purpose") not in PURPOSES:
                conn.close()  # not one of this engine's ranks
                continue
            found.setdefault(int(hello["rank"]), {})[hello["purpose"]] = conn
        return found

    def close(self) -> None:
        self.server.close()


def connect(launch: Launch, store: dist.Store, timeout: float) -> dict[str, Connection]:
    """A worker's end: its connections to rank 0, by purpose (rank 0's address read from the store)."""
    store.set_timeout(timedelta(seconds=timeout))
    control = json.loads(store.get(CONTROL_KEY))
    conns = {}
    for purpose in PURPOSES:
        sock = socket.create_connection((control["host"], control["port"]), timeout=timeout)
        sock.settimeout(None)
        conns[purpose] = Connection(sock.detach())
        conns[purpose].send_bytes(json.dumps({"token": control["token"], "rank": launch.rank,
                                              "purpose": purpose}).encode())
    return conns


def _hello(conn: Connection) -> dict | None:
    try:
        if not conn.poll(HELLO_TIMEOUT):
            return None
        hello = json.loads(conn.recv_bytes(4096))
        return hello if isinstance(hello, dict) else None
    except (OSError, EOFError, ValueError):
        return None
