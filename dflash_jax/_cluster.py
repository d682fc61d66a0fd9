"""The CLI's side of a jax.distributed cluster: the `--coordinator` address checked before anything starts, the
cluster joined within a deadline (an unreachable coordinator is one error, not JAX's abort), and the loaded models
compared across the processes, a process that failed to load them ending every process with an error.

JAX's coordination client ends the process (a C++ check failure, SIGABRT) when it cannot connect in its
`initialization_timeout`, so `join` first waits for the coordinator to answer on TCP itself, within the user's
`--coordinator-timeout`, and says so when it does not.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import time
from typing import Any

# A deadline on each connection attempt to the coordinator, and the pause between attempts.
PROBE_SECONDS = 1.0
PROBE_PAUSE = 0.2


def coordinator_address(text: str) -> str:
    """argparse type of `--coordinator`: HOST:PORT (an IPv6 host in brackets, `[::1]:1234`), port 1-65535;
    returned as given."""
    split_address(text)
    return text


def split_address(text: str) -> tuple[str, int]:
    """`(host, port)` of HOST:PORT (the brackets of an IPv6 host removed); argparse.ArgumentTypeError if it is not
    one."""
    if "://" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is a URL: give HOST:PORT, e.g. 10.0.0.1:1234")
    host, colon, port = text.rpartition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r} has no port: give HOST:PORT, e.g. {text}:1234")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"{text!r}: write an IPv6 host in brackets, e.g. [::1]:1234")
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise argparse.ArgumentTypeError(f"{text!r} has no valid host: give HOST:PORT, e.g. 10.0.0.1:1234")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: the port {port!r} is not a number from 1 to 65535")
    return host, int(port)


def join(address: str | None, num_processes: int | None, process_id: int | None, timeout: int) -> None:
    """`jax.distributed.initialize` with `timeout` seconds to connect and to shut down, process 0's coordinator
    listening on `address` alone (JAX's default is every interface). Before JAX starts, process 0 checks that it
    can listen there, and every other process waits up to `timeout` seconds for the coordinator to accept a TCP
    connection: ValueError naming `--coordinator` when either fails. Each says on stderr what it waits for. With
    no address (a SLURM, Open MPI or Kubernetes cluster) JAX finds the coordinator itself, and these checks are
    skipped."""
    import jax

    if address is not None and process_id is not None:
        host, port = split_address(address)
        others = f"the other {num_processes - 1} process(es)" if num_processes else "the other processes"
        waits = f"{others} to join at {address}" if process_id == 0 else f"the coordinator (process 0) at {address}"
        print(f"process {process_id}: waiting up to {timeout} s for {waits} (--coordinator-timeout)",
              file=sys.stderr, flush=True)  # a peer that never starts is otherwise a silent wait
        if process_id == 0:
            check_listen(address, host, port)
        else:
            wait_for(address, host, port, timeout)
    jax.distributed.initialize(address, num_processes, process_id, initialization_timeout=timeout,
                               shutdown_timeout_seconds=timeout, coordinator_bind_address=address)


def check_listen(address: str, host: str, port: int) -> None:
    """ValueError when this process cannot listen on `host`:`port` (a host of another machine, a port in use)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ValueError(f"--coordinator {address}: process 0 cannot resolve {host!r}: {e.strerror or e}") from None
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(where)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise ValueError(f"--coordinator {address}: process 0 cannot listen there ({why}); process 0 is the "
                             "coordinator, so HOST must be one of its own addresses") from None


def wait_for(address: str, host: str, port: int, timeout: float) -> None:
    """Return once `host`:`port` accepts a TCP connection; ValueError after `timeout` seconds of refusals."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"--coordinator {address}: no coordinator answered within {timeout:g} s ({last}); is "
                             "process 0 running with the same --coordinator? (--coordinator-timeout sets the wait)")
        try:
            with socket.create_connection((host, port), timeout=min(PROBE_SECONDS, left)):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
            time.sleep(min(PROBE_PAUSE, max(0.0, deadline - time.monotonic())))


def digest(text: str):
    """`[8]` uint8: the first 8 bytes of the SHA-256 of `text`."""
    import hashlib

    import numpy as np

    return np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.uint8)


# The rows of `check_same_models`'s all-gather: whether the process loaded its models, then its models' configs.
MODELS = ("loaded", "the target's config", "the drafter's config")


def check_same_models(configs: tuple[Any, Any] | None, failure: BaseException | None) -> None:
    """After every process has loaded (or failed to load) its target and drafter: one all-gather of whether each
    loaded them and a digest of each model's parsed config (`repr`: every field). Every process then raises
    together, so none is left waiting in a collective for one that has given up: this process's own `failure`,
    else ValueError naming a process that failed to load, else ValueError naming the model whose config differs
    between this process and another (the processes run one program: different models would compute garbage)."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.stack([np.full(8, failure is None, np.uint8)]
                    + [digest(repr(c) if configs else "") for c in (configs or (None, None))])
    everyone = multihost_utils.process_allgather(mine)  # [processes, 3, 8]
    if failure is not None:
        raise failure
    for process, theirs in enumerate(everyone):
        if not theirs[0].all():
            raise ValueError(f"process {process} failed to load its models (its own error line says why): every "
                             "process of a --distributed run must load the same target and drafter")
    for process, theirs in enumerate(everyone):
        for name, a, b in zip(MODELS[1:], mine[1:], theirs[1:]):
            if (a != b).any():
                raise ValueError(f"{name} differs between this process and process {process}: every process of a "
                                 "--distributed run must load the same target and drafter")
