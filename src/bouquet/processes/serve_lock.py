"""How `bouquet serve`'s replicas know that its gateways are gone when serve itself was killed (SIGKILL). Its
gateways then drain their requests (SIGTERM from the kernel) and its replicas must serve them until they have:
every gateway process holds a shared lock on one file for as long as it lives, and an orphaned replica waits for
the exclusive lock, which it gets the moment the last gateway has exited, however it exited (the kernel drops a
dead process's locks). Without the file (a replica not started by serve), it waits for its calls to stop."""

from __future__ import annotations

import fcntl
import logging
import os

logger = logging.getLogger(__name__)

ENV = "BOUQUET_GATEWAYS_LOCK"  # the lock file's path, set by serve for its gateways and replicas
_held: list[int] = []  # the gateway's descriptor, open for the life of the process


def create(path: str) -> None:
    """In serve, before its children start: the file the gateways lock (a replica never creates it: a file made
    anew after the gateways locked another would read as free)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    os.environ[ENV] = path


def hold_while_alive() -> None:
    """In a gateway process: holds the shared lock until the process exits (no-op unless serve set the path)."""
    path = os.environ.get(ENV)
    if not path or _held:
        return
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(descriptor, fcntl.LOCK_SH)
    except OSError as error:  # a file system without locks, a stale path: the replicas fall back on their calls
        logger.warning("cannot hold %s (%s); orphaned replicas will stop once their calls pause", path, error)
        return
    _held.append(descriptor)


def gateways_gone() -> bool | None:
    """In a replica: whether no gateway holds the lock now; None without a lockable file from serve (the caller
    falls back on its calls pausing). Polled rather than waited on in a thread, which would hold the replica's
    exit while the gateways live."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(descriptor)  # releases the lock if it was taken
    return True
