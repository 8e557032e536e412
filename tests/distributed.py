"""Run a function in N gloo processes on this CPU, the way torchrun would set them up."""
import os
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    fn(rank, world_size, *args)


def spawn(fn, world_size, *args):
    """Run fn on world_size processes. Once more on a fresh port if gloo could not connect its ranks at all (seen once
    in a full slow run on a 2-core machine: "connectFullMesh failed ... Connection closed by peer", before any of the
    test's code ran; the test passed on each rerun): an error of the machine's sockets, not of the code under test."""
    for attempt in (1, 2):
        try:
            return mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as e:
            if attempt == 2 or "connectFullMesh failed" not in str(e):
                raise


def start(fn, world_size, *args) -> list:
    """Like spawn, without waiting: the started processes, for a test that watches each one (a rank
    that must stop on its own while another hangs)."""
    port, context = free_port(), mp.get_context("spawn")
    procs = [context.Process(target=_entry, args=(rank, fn, world_size, port, args), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return procs
