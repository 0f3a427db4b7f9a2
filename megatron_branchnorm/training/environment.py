"""The process a rank runs in: rank and world from the launcher, SLURM or nothing (one
process), torch's thread count, the process group (a bounded rendezvous, DeepSpeed's CPU op
built first), and the cleanup DeepSpeed's CPU accelerator leaves to us."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_branchnorm.config import ConfigError
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import one_line, quote
from megatron_branchnorm.runner.launch import AGENT_STORE, RENDEZVOUS_FD
from megatron_branchnorm.training import collectives, stop_signals
from megatron_branchnorm.training.exit_codes import PEER_LOST_EXIT_CODE

SHM_COMM_BUILDER = "ShareMemCommBuilder"
"""DeepSpeed's CPU shared-memory all-reduce op, which ``deepspeed.init_distributed`` builds
(ninja, in torch's extensions directory) on CPU ranks."""


class PeerLostError(UserError, RuntimeError):
    """Starting failed because another rank, or its node, is gone: one line, exit 4
    (``training.trainer.run`` reads it before any front door, which would print a
    :class:`UserError` with exit 2), like a collective that lost its peer."""


def setup_process_env() -> None:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* for a single process or from SLURM, so
    ``deepspeed.init_distributed`` never falls into MPI discovery; and this interpreter's
    ninja first on PATH for the op a CPU rank builds (:func:`interpreter_ninja_first`): every
    process that starts DeepSpeed comes here first (the trainer, the GPU check, the benches)."""
    interpreter_ninja_first()
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        _env_int("SLURM_PROCID", 0)
        _env_int("SLURM_NTASKS", 1)
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if "RANK" not in env:
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            env.update(own_rendezvous())
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    check_process_env()
    host_rendezvous()


_HOSTED: list[dist.TCPStore] = []
"""The rendezvous stores this process hosts, held for its life (a process group started again
meets there too)."""


def own_rendezvous() -> dict[str, str]:
    """MASTER_ADDR, MASTER_PORT and :data:`AGENT_STORE` of a rendezvous store this process hosts
    for itself, a world of one (opened on first use, on a port the system picks): no port is
    chosen, freed and bound again, which any other socket of the machine could take meanwhile."""
    if not _HOSTED:
        _HOSTED.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_HOSTED[0].port), AGENT_STORE: "True"}


def host_rendezvous() -> None:
    """On rank 0 started with :data:`RENDEZVOUS_FD` (``runner.ranks.start_ranks``: a socket that
    listens on MASTER_PORT since the port was chosen), host the rendezvous store on that socket
    and join it as a client like every other rank (:data:`AGENT_STORE`); nothing otherwise. The
    port is never free between its choice and the rendezvous."""
    fd = _env_int(RENDEZVOUS_FD, 0)
    if fd is None:
        return
    del os.environ[RENDEZVOUS_FD]
    try:
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "0")),
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"environment variable {RENDEZVOUS_FD}: {fd} is not a socket listening on "
            f"MASTER_PORT ({one_line(str(exc), 200)})"
        ) from None
    os.set_inheritable(fd, False)  # the rank's own children do not hold the port
    _HOSTED.append(store)
    os.environ[AGENT_STORE] = "True"


def _env_int(name: str, low: int, high: int | None = None) -> int | None:
    """The integer in environment variable ``name`` (None when unset), or ConfigError naming
    the variable: not a plain decimal integer, below ``low`` or above ``high``."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    text = raw.strip()
    value = int(text) if text.isdigit() and len(text) <= 10 else None
    if value is None or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ConfigError(f"environment variable {name}: expected {bound}, got {quote(raw)}")
    return value


def check_process_env() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE and MASTER_PORT as a launcher sets them, or a
    one-line ConfigError naming the variable (a non-integer, a negative, RANK >= WORLD_SIZE, a
    port outside 1..65535, RANK without WORLD_SIZE) before torch.distributed raises a
    traceback or waits forever."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if rank is not None and world is None:
        raise ConfigError(
            f"environment variable WORLD_SIZE: not set, but RANK is ({rank}): a launcher sets "
            "both; set WORLD_SIZE too, or unset RANK for a single process"
        )
    if rank is not None and world is not None and rank >= world:
        raise ConfigError(
            f"environment variable RANK: {rank}, but WORLD_SIZE is {world} (ranks are "
            f"0..{world - 1})"
        )
    _env_int("LOCAL_SIZE", 1)
    _env_int("LOCAL_WORLD_SIZE", 1)
    _env_int("LOCAL_RANK", 0)
    _env_int("MASTER_PORT", 1, 65535)


def local_ranks() -> int:
    """Ranks on this node: the launcher's or SLURM's count, else the world size."""
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)
    return local if local > 0 else max(1, int(os.environ.get("WORLD_SIZE", "1")))


def set_thread_count() -> int:
    """torch threads = cores / local ranks (the launcher sets OMP only with core binding)."""
    local = local_ranks()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, local))
    if "OMP_NUM_THREADS" in os.environ:
        raw = os.environ["OMP_NUM_THREADS"]
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ConfigError(
                f"environment variable OMP_NUM_THREADS: expected a count >= 1, got {raw!r}"
            )
        threads = int(raw)
    torch.set_num_threads(threads)
    return threads


def bind_device() -> torch.device:
    """Bind this rank's GPU from LOCAL_RANK; the CPU when there is no GPU.

    Must run before the first collective: under NCCL, torch puts the tensors of an object
    collective on ``torch.cuda.current_device()``, which is GPU 0 on every rank of a node until
    each binds its own, and NCCL refuses two ranks on one GPU. DeepSpeed's engine binds the
    device only in ``deepspeed.initialize``, after our first collectives (the run lock).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if not 0 <= local < count:
        raise ConfigError(
            f"environment variable LOCAL_RANK: {local}, but this process sees {count} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); every "
            "rank of a node must see all of the node's GPUs (slurm/common.sh: --gres=gpu:N)"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_process_group(timeout_s: float) -> tuple[int, int]:
    """Bind this rank's GPU, then DeepSpeed's process group (NCCL on GPUs, gloo on CPU
    ranks); (rank, world size).

    The rendezvous (rank 0 listens on MASTER_ADDR:MASTER_PORT, every other rank connects)
    waits at most ``timeout_s`` (``train.collective_timeout_s``, also every collective's
    timeout): after that the rank ends with one line naming the address, exit 4. torch alone
    would wait up to twice that, inside C++, and rank 0 would end with a traceback. On CPU
    ranks DeepSpeed's shared-memory op is built before (:func:`load_shm_comm_op`), so that a
    slow first build does not count against the rendezvous.

    DeepSpeed 0.19.8 passes ``device_id=cuda:LOCAL_RANK`` to torch's ``init_process_group``
    itself at world size > 1 (``deepspeed/comm/torch.py``), which makes NCCL's communicator
    eager and bound to that GPU; at world size 1 it leaves it out on purpose (DeepSpeed PR #8248).
    """
    import deepspeed

    check_master_addr()
    host_rendezvous()
    device = bind_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo" and not dist.is_initialized():
        load_shm_comm_op(timeout_s)
    try:
        with _deadline(timeout_s, lambda: _rendezvous_line(timeout_s, "")):
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    except (dist.DistNetworkError, dist.DistStoreError) as exc:
        # The rendezvous store (rank 0 listens on MASTER_PORT): a busy port is the user's
        # environment, not a bug, so one line naming the variable instead of a traceback.
        where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        text = one_line(str(exc), 300)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise ConfigError(
                f"environment variable MASTER_PORT: {where} is already in use (another run "
                "or program listens there); choose a free port (deepspeed --master_port P, "
                "or MASTER_PORT=P)"
            ) from None
        if "timed out" in text.lower():  # torch's own timeout, a moment after _deadline's
            stop_signals.stop_now(_rendezvous_line(timeout_s, text), PEER_LOST_EXIT_CODE)
        raise ConfigError(
            f"environment variables MASTER_ADDR/MASTER_PORT: cannot rendezvous at {where}: {text}"
        ) from None
    rank = dist.get_rank()
    if backend == "gloo":
        release_shm_workspace(rank)
    return rank, dist.get_world_size()


def check_master_addr() -> None:
    """End the process with one line, exit 4 (as a rendezvous that cannot complete), when
    MASTER_ADDR does not resolve: the rendezvous would retry it until
    ``train.collective_timeout_s``, though a name the resolver does not know never comes to
    resolve. A temporary failure of the resolver (EAI_AGAIN) is left to the rendezvous."""
    env = os.environ
    addr = env.get("MASTER_ADDR")
    if addr is None:  # no rendezvous address at all: the launcher environment's check says so
        return
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            return
        why = exc.strerror or str(exc)
    except UnicodeError as exc:  # a label longer than 63 characters, an empty label
        why = one_line(str(exc), 200)
    else:
        return
    stop_signals.stop_now(
        f"error: rank {env.get('RANK', '0')}: MASTER_ADDR {quote(addr)} does not resolve "
        f"({why}): check MASTER_ADDR",
        PEER_LOST_EXIT_CODE,
    )


def _rendezvous_line(timeout_s: float, detail: str) -> str:
    """The line of a rendezvous that did not complete within ``timeout_s``."""
    env = os.environ
    rank, world = env.get("RANK", "0"), env.get("WORLD_SIZE", "1")
    where = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    role = (
        f"rank 0 listens there, and not all {world} ranks connected"
        if rank == "0"
        else "rank 0 could not be reached there"
    )
    return (
        f"error: rank {rank}: the rendezvous at MASTER_ADDR:MASTER_PORT {where} did not "
        f"complete within {timeout_s:g} s (train.collective_timeout_s): {role}"
        + (f" ({detail})" if detail else "")
        + f"; check MASTER_ADDR, MASTER_PORT and WORLD_SIZE={world}, and that every rank started"
    )


@contextlib.contextmanager
def _deadline(seconds: float, overdue: Callable[[], str | None]) -> Iterator[None]:
    """End the process with the line ``overdue()`` returns, exit 4, when the block still runs
    after ``seconds`` (None from it: wait another ``seconds``). For waits inside C++ or a
    library's loop (gloo's rendezvous, torch's build lock) that no exception reaches; the
    watcher of :mod:`megatron_branchnorm.training.stop_signals` still ends them on SIGTERM/SIGINT."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(seconds):
            line = overdue()
            if line is not None:
                stop_signals.stop_now(line, PEER_LOST_EXIT_CODE)

    threading.Thread(target=watch, name="start-up-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def load_shm_comm_op(timeout_s: float) -> None:
    """Build or load DeepSpeed's CPU shared-memory communication op now, as
    ``deepspeed.init_distributed`` would inside it on a CPU rank (``deepspeed/comm/torch.py``,
    ``build_shm_op``, which then finds the op loaded), so that its failures are one line:

    - a build interrupted under this rank (ninja stopped: when another rank is lost, DeepSpeed's
      launcher terminates the survivors' process trees, ninja first) is this rank's own stop
      when SIGTERM or SIGINT reached it too (``stop_signals.stop_if_signalled``), otherwise a
      :class:`PeerLostError` (exit 4) instead of ninja's traceback;
    - torch's build lock (``lock`` in the op's build directory) makes every load wait, built or
      not, with no message and no time limit (torch's ``FileBaton``). A lock that no process
      of this node builds under is one line at once when it is there before the load
      (:func:`build_lock_line`), and one every :data:`BUILD_LOCK_NOTE_S` while the rank waits
      for it; held for over ``timeout_s`` that way, it was left by a rank killed while
      building, and the rank ends with a line naming it, exit 4. The rank waits rather than
      failing at once: another node sharing the directory may be building (this node cannot
      see its processes), and the lock of a build of this node exists for a moment before
      ninja starts there.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(SHM_COMM_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    if installed_ops.get(builder.name, False):
        builder.load()
    else:  # built just in time, under torch's build lock, with the ninja setup_process_env chose
        load_op(builder, timeout_s)


def interpreter_ninja_first() -> None:
    """Put this interpreter's bin/ first on this process's PATH when a ``ninja`` is there, so
    that torch builds the op with it whichever way the rank was started.

    torch builds the op with the first ``ninja`` on PATH, in one build directory per user and
    Python version. A virtualenv's ninja (the pip wheel) and the system's (another version)
    each take the other's build log for a changed command: ranks started by
    ``.venv/bin/python train.py`` (the system's ninja first) and by the deepspeed launcher or
    an sbatch script (the virtualenv's first) rebuilt the op from scratch at every switch,
    30-50 s of every core on the node each time."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ninja").is_file():
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != str(bin_dir):
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}" if path else str(bin_dir)


BUILD_LOCK_NOTE_S = 60.0
"""Seconds between the lines of a rank that waits for a build lock no process of its node
holds."""
BUILD_LOCK_FRESH_S = 10.0
"""A build lock younger than this is taken for a load or build that just began (torch holds
the lock for milliseconds to load a built op, and a build runs ninja in the directory within
seconds): no line at once for it."""


def load_op(builder: Any, timeout_s: float) -> None:
    """``builder.load()`` for an op that torch builds just in time (:func:`load_shm_comm_op`):
    a build lock already there is said at once, then every :data:`BUILD_LOCK_NOTE_S` while no
    process of this node builds there, and ends the rank (exit 4) after ``timeout_s``."""
    name = builder.name
    loaded = name in getattr(builder, "_loaded_ops", {})  # this process has it: no build
    line = None if loaded else build_lock_line(name, timeout_s)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    with (
        _deadline(timeout_s, lambda: _stale_build_lock(name, timeout_s)),
        _every(BUILD_LOCK_NOTE_S, lambda: _waiting_line(name)),
    ):
        try:
            builder.load()
        except RuntimeError as exc:
            if not _build_interrupted(exc):
                raise
            stop_signals.stop_if_signalled()
            raise PeerLostError(
                f"DeepSpeed's CPU communication op ({name}) was being built when its "
                f"build was stopped ({one_line(str(exc), 200)}): another rank, or its node, "
                "is gone and the job is being ended"
            ) from None


def build_lock_path(name: str) -> Path:
    """torch's build lock of extension ``name``: ``TORCH_EXTENSIONS_DIR/NAME/lock``, else under
    torch's per-user cache (``~/.cache/torch_extensions/py311_cpu/NAME/lock`` for Python 3.11
    and a CPU build of torch; ``cu128`` and the like for a CUDA build)."""
    from torch.utils.cpp_extension import _get_build_directory  # where load() puts it

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def build_lock_line(name: str, timeout_s: float) -> str | None:
    """The line of a rank about to load extension ``name`` whose build lock is already there,
    older than :data:`BUILD_LOCK_FRESH_S`, with no process of this node building under it
    (left by one that died while building, or held by another node's build); None otherwise:
    no lock, or a load or build that is running."""
    lock = build_lock_path(name)
    try:
        age_s = max(0.0, time.time() - lock.stat().st_mtime)
    except FileNotFoundError:
        return None
    if age_s < BUILD_LOCK_FRESH_S or _works_in(lock.parent):
        return None
    return (
        f"rank {os.environ.get('RANK', '0')}: a build lock {lock} exists, {age_s:.0f} s old "
        f"(left by a process that died while building {name}?); this rank waits for it up to "
        f"train.collective_timeout_s={timeout_s:g} s: if no other process is building {name}, "
        f"remove {lock}"
    )


def _waiting_line(name: str) -> str | None:
    """The reminder of a rank still waiting for the build lock of ``name`` while no process of
    this node builds there; None while it is building, or without a lock."""
    lock = build_lock_path(name)
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age_s < BUILD_LOCK_NOTE_S or _works_in(lock.parent):
        return None
    return (
        f"rank {os.environ.get('RANK', '0')}: still waiting for the build lock {lock}, "
        f"{age_s:.0f} s old, that no process of this node builds under: if no other node is "
        f"building {name}, remove {lock}"
    )


@contextlib.contextmanager
def _every(seconds: float, line: Callable[[], str | None]) -> Iterator[None]:
    """Print the line ``line()`` returns (None: nothing) on stderr every ``seconds`` while the
    block runs."""
    done = threading.Event()

    def remind() -> None:
        while not done.wait(seconds):
            text = line()
            if text is not None:
                print(text, file=sys.stderr, flush=True)

    threading.Thread(target=remind, name="start-up-reminder", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _build_interrupted(exc: RuntimeError) -> bool:
    """Whether ``exc`` is torch's "Error building extension" for a ninja that was stopped
    (a signal), rather than a build that failed."""
    if "build stopped: interrupted" in str(exc):  # ninja's own words for a signal
        return True
    code = getattr(exc.__cause__, "returncode", None)  # ninja's CalledProcessError
    return isinstance(code, int) and code < 0


def _stale_build_lock(name: str, timeout_s: float) -> str | None:
    """The line for torch's build lock of extension ``name`` when it is stale (held over
    ``timeout_s`` while no process of this node works in its directory); None otherwise."""
    lock = build_lock_path(name)
    try:
        held_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None  # building or loading: wait on
    if held_s < timeout_s or _works_in(lock.parent):
        return None
    return (
        f"error: rank {os.environ.get('RANK', '0')}: DeepSpeed's CPU communication op waits "
        f"for the build lock {lock}, held for {held_s:.0f} s (train.collective_timeout_s is "
        f"{timeout_s:g}) while no process of this node builds there: a rank killed while "
        "building left it; if no other node is building, remove that file and resubmit"
    )


def _works_in(directory: Path) -> bool:
    """Whether a process of this node has ``directory`` as its working directory (torch runs
    ninja, and ninja the compilers, in the build directory)."""
    target = os.path.realpath(directory)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone, or another user's
                if os.readlink(entry / "cwd") == target:
                    return True
    return False


def release_shm_workspace(rank: int) -> None:
    """Unlink this rank's name of DeepSpeed's CPU shared-memory all-reduce workspace.

    On the CPU accelerator, ``init_distributed`` builds ``deepspeed_shm_comm``, whose
    ``shm_initialize`` creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (66 MB) and maps every peer's segment, but never unlinks the names: every launch leaves
    66 MB per rank in /dev/shm (RAM), even on a clean exit (15 GB after a day of tests here).
    Once all ranks are past ``init_distributed`` (the barrier) every peer has mapped this
    segment, so the name can go: the mappings stay valid until each process exits, and nothing
    is left behind, not even after a kill -9.
    """
    collectives.barrier()
    env = os.environ
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}"
        f"_{env.get('MASTER_PORT', '')}_{rank}"
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path("/dev/shm") / name)


# What the backends say when a peer is gone: gloo's TCP pair ("Connection reset by peer",
# "Connection closed by peer", "Read error", "Broken pipe", a timed-out wait) and NCCL's
# remote error (DistBackendError: "remote process exited or there was a network error").
_PEER_GONE = re.compile(
    r"Connection (reset|closed|refused) by peer|Broken pipe|Read error|Timed out waiting|"
    r"remote process exited|ncclRemoteError|network error",
    re.IGNORECASE,
)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective or point-to-point failing because another rank (or its
    node, or the network to it) is gone, rather than a bug of this rank; or starting failing
    for that (:class:`PeerLostError`)."""
    if isinstance(exc, PeerLostError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    gloo_or_nccl = "gloo" in text or "NCCL" in text or isinstance(exc, dist.DistError)
    return gloo_or_nccl and _PEER_GONE.search(text) is not None


def destroy_process_group() -> None:
    """End the process group, when there is one (see :func:`megatron_branchnorm.training.run`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_memory_bytes() -> float:
    """Memory of this rank's device: the bound GPU's, or on CPU ranks the machine's physical
    memory shared by the ranks of this node (what the planner's "auto" choices are made for)."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / local_ranks()


def peak_reserved_mb() -> float | None:
    """Peak memory the GPU's caching allocator held for this rank (allocations and the blocks
    it keeps cut up: what runs out first when fragmentation grows over a long run); None on
    the CPU, which has no such allocator. Reads the allocator's counters: no device sync."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**20
    return None


def peak_memory_mb() -> float:
    """Peak memory of this rank: the GPU's allocations, or the process's resident set."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
