"""Megatron-core on several processes: set-up of a worker, a watchdog that ends the job's ranks when one of
them is gone, a launcher for tests, and the tensor-parallel grad work that Megatron's DDP would otherwise do.

A worker calls `init_distributed(tp)` (gloo; rank and world size from the arguments or torchrun's
environment); a program that sets up the process group itself calls `watch_ranks()` after it. Tests start
workers with `run_on_ranks(fn, ...)`: one fresh Python process per rank, a FileStore rendezvous (no port to
pick), each rank's return value handed back, and every process killed on the first failure or at the timeout.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import importlib.util
import inspect
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_glue.capture import adapt, quiet_megatron


def init_distributed(tp: int, *, rank: int | None = None, world_size: int | None = None,
                     store: dist.Store | None = None, groups: Sequence[str] | None = None,
                     timeout: datetime.timedelta | float | None = None, rank_watchdog_s: float | None = None,
                     **model_parallel: Any) -> None:
    """In a worker: apply the adaptations (`groups`, default `adaptations.groups_for()`, the same as
    `megatron_glue.adapt()`), join the gloo process group (rank and world size default to $RANK/$WORLD_SIZE,
    the store to run_on_ranks' FileStore or else env://), watch the other ranks (`watch_ranks(rank_watchdog_s)`)
    and set Megatron's model-parallel state to TP=tp, PP=1 or `pipeline_model_parallel_size=` (data parallel takes the remaining ranks;
    `model_parallel` goes to Megatron's initialize_model_parallel). Sequence parallelism is a model-config switch
    (`sequence_parallel=True`) that needs nothing more here. A process group initialised before (e.g. a fake
    one) is kept.

    `timeout`: how long a collective may wait (a timedelta, or seconds), default Megatron-LM's
    `--distributed-timeout-minutes` default, 10 minutes."""
    adapt(groups)
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if store is None and "NPU_COMPILE_STORE" in os.environ:  # started by run_on_ranks
            store = worker_store()
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        if timeout is None:
            timeout = DEFAULT_COLLECTIVE_TIMEOUT
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    watch_ranks(rank_watchdog_s)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with quiet_megatron():
        pp = model_parallel.pop("pipeline_model_parallel_size", 1)
        parallel_state.initialize_model_parallel(tp, pp, **model_parallel)


# -- ranks that are gone -------------------------------------------------------------------------------------
#
# A collective waits for every rank of its group. gloo notices a peer whose process exited on this host (its
# sockets close) and fails with "Connection reset by peer <address>", naming no rank; a peer that is stopped,
# hung or on a host that went away keeps its sockets open, and the collective waits out the process group's
# timeout. The watchdog bounds both: every rank beats into the process group's store and watches the next
# rank that is still in the job (ring order, so each rank reads one heartbeat); a rank whose process is gone
# (same host: its pid has exited) or whose heartbeat stopped for `seconds` is reported in the store, and every
# rank ends with "rank R (pid P) is gone: ...".

DEFAULT_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # Megatron-LM's --distributed-timeout-minutes default
WATCHDOG_ENV = "NPU_COMPILE_RANK_WATCHDOG_S"
DEFAULT_WATCHDOG_S = 60.0
# After a loss is found, how long the main thread may take to end by itself (it may be unwinding gloo's own
# error) before the watchdog ends the process: a collective blocked in C++ can be neither interrupted nor
# aborted on gloo.
_GRACE_S = 2.0


class RankLostError(RuntimeError):
    """A rank of this job is gone; the message names it: "rank R (pid P) is gone: why"."""


def watchdog_seconds(seconds: float | None = None) -> float:
    """The watchdog's bound in seconds: `seconds`, else $NPU_COMPILE_RANK_WATCHDOG_S, else 60; 0 turns it off."""
    if seconds is None:
        text = os.environ.get(WATCHDOG_ENV)
        if not text:
            return DEFAULT_WATCHDOG_S
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{WATCHDOG_ENV}={text!r} is not a number of seconds; give e.g. 30, or 0 to turn the "
                             "rank watchdog off") from None
        where = f"{WATCHDOG_ENV}={text!r}"
    else:
        where = f"rank_watchdog_s={seconds!r}"
    if not seconds >= 0 or seconds == float("inf"):  # NaN too
        raise ValueError(f"{where} must be a finite number of seconds >= 0 (0 turns the rank watchdog off)")
    return float(seconds)


def _host_identity() -> str:
    """Processes with the same identity can see each other's pids: one host (boot) and one pid namespace."""
    parts = [socket.gethostname()]
    for path, read in (("/proc/sys/kernel/random/boot_id", lambda p: open(p).read().strip()),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(read(path))
        except OSError:
            pass
    return "/".join(parts)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), to tell it from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _process_exited(pid: int, start_time: str) -> bool:
    """Whether process `pid` (started at `start_time`, "" if unknown) of this host has exited: gone, a zombie
    not yet reaped, or its pid taken by another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, run by another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False  # no /proc (not Linux): kill(pid, 0) is all there is to know
    return fields[0] in ("Z", "X") or bool(start_time and fields[19] != start_time)


class RankWatchdog:
    """This rank's heartbeat and its watch on the next live rank, in a daemon thread; see the section above.

    Keys, under a prefix of the process group's store: who/R ("pid start-time host-identity hostname"), beat/R
    (a counter), done/R (rank R left the job in order: its process group destroyed, or it exited normally),
    lost (the first loss found, as its message)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, seconds: float, generation: int):
        self.rank, self.world_size, self.seconds = rank, world_size, seconds
        self.interval = min(2.0, max(0.05, seconds / 10))
        try:
            store = store.clone()  # its own connection: never queued behind the main thread's store calls
        except Exception:  # noqa: BLE001 - a store that cannot be cloned is shared
            pass
        self.store = dist.PrefixStore(f"megatron_glue_rank_watchdog/{generation}", store)
        self.store.set_timeout(datetime.timedelta(seconds=max(1.0, seconds)))
        self.group = dist.group.WORLD
        self.lost: str | None = None
        self._stop = threading.Event()
        self._beats = 0
        self._peers: dict[int, tuple[int, str, str, str]] = {}  # rank -> (pid, start time, identity, hostname)
        self._identity = _host_identity()
        self.store.set(f"who/{rank}", f"{os.getpid()} {_start_time(os.getpid())} {self._identity} "
                                      f"{socket.gethostname()}")
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"megatron_glue-rank-watchdog-{rank}", daemon=True)
        self._thread.start()

    # -- the thread
    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", str(self._beats))

    def _run(self) -> None:
        watched, last_beat, changed_at = None, None, time.monotonic()
        store_ok_at = time.monotonic()
        while not self._stop.wait(self.interval):
            if not dist.is_initialized() or dist.group.WORLD is not self.group:
                self.leave()  # the process group this watch was for is destroyed: this rank left in order
                return
            try:
                self._beat()
                lost = self._get("lost")
                if lost is None:
                    successor = self._next_live()
                    if successor is None:
                        return  # every other rank has left in order
                    if successor != watched:
                        watched, last_beat, changed_at = successor, None, time.monotonic()
                    beat = self._get(f"beat/{watched}")
                    if beat != last_beat:
                        last_beat, changed_at = beat, time.monotonic()
                    lost = self._exited(watched)
                    if lost is None and time.monotonic() - changed_at > self.seconds:
                        lost = self._describe(watched, f"no heartbeat for {time.monotonic() - changed_at:.1f} s "
                                              "(stopped, hung, or its host is unreachable)")
                    if lost is not None:
                        lost += f" (found by rank {self.rank})"
                        self.store.set("lost", lost)
                store_ok_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store itself failing is what is watched here
                if time.monotonic() - store_ok_at <= self.seconds:
                    continue
                lost = (f"the process group's store has not answered for {time.monotonic() - store_ok_at:.1f} s "
                        f"({type(e).__name__}: {e}): whoever hosts it (rank 0, or torchrun's agent) is gone")
            if lost is not None:
                self._end(lost)
                return

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _next_live(self) -> int | None:
        for step in range(1, self.world_size):
            r = (self.rank + step) % self.world_size
            if not self.store.check([f"done/{r}"]):
                return r
        return None

    def _peer(self, r: int) -> tuple[int, str, str, str] | None:
        if r not in self._peers:
            who = self._get(f"who/{r}")
            if who is None:
                return None  # not watching yet: its heartbeat is missing, and counts as stopped
            pid, start, identity, hostname = who.split(" ", 3)
            self._peers[r] = (int(pid), start, identity, hostname)
        return self._peers[r]

    def _describe(self, r: int, why: str) -> str:
        peer = self._peer(r)
        if peer is None:
            return f"rank {r} is gone: {why}"
        pid, _, identity, hostname = peer
        on = "" if identity == self._identity else f" on {hostname}"
        return f"rank {r} (pid {pid}{on}) is gone: {why}"

    def _exited(self, r: int) -> str | None:
        peer = self._peer(r)
        if peer is None or peer[2] != self._identity or self.store.check([f"done/{r}"]):
            return None
        return self._describe(r, "its process has exited") if _process_exited(peer[0], peer[1]) else None

    def _end(self, lost: str) -> None:
        self.lost = lost
        message = (f"[rank {self.rank}] {RankLostError.__name__}: {lost}; ending rank {self.rank} rather than "
                   f"wait for it in a collective (the rank watchdog's {self.seconds:g} s, ${WATCHDOG_ENV})")
        print(message, file=sys.stderr, flush=True)
        if self._stop.wait(_GRACE_S):
            return  # stopped meanwhile: the main thread ended by itself
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    # -- the main thread
    def find_lost(self, wait: float) -> str | None:
        """The loss found so far, by this rank or another; else look now (a peer of this host that exited),
        for up to `wait` seconds. None if every rank seems alive."""
        deadline = time.monotonic() + wait
        while True:
            if self.lost is not None:
                return self.lost
            try:
                lost = self._get("lost")
                if lost is not None:
                    return lost
                for r in range(self.world_size):
                    if r != self.rank and (lost := self._exited(r)) is not None:
                        return lost
            except Exception:  # noqa: BLE001 - a store that does not answer says nothing here
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.1, self.interval))

    def leave(self) -> None:
        """This rank leaves the job in order: its watcher stops watching it, and this watch stops."""
        self._stop.set()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - nobody left to tell
            pass

    def stop(self) -> None:
        self._stop.set()


_watchdog: RankWatchdog | None = None
_generation = 0
_uncaught = False  # an exception reached the top of the main thread: exiting is not leaving in order
_hooked = False


def watch_ranks(seconds: float | None = None, store: dist.Store | None = None) -> RankWatchdog | None:
    """Watch the other ranks of the initialised process group (call on every rank, after init_process_group):
    a rank whose process exits, or whose heartbeat stops for `seconds` (default `watchdog_seconds()`:
    $NPU_COMPILE_RANK_WATCHDOG_S or 60), ends every other rank within about that time with
    "rank R (pid P) is gone: ..." (on stderr, and as a RankLostError chained to the error that ends the main
    thread, e.g. gloo's). `store`: default the process group's own. Returns the watchdog, or None when there is
    nothing to watch (one rank, a fake process group, seconds 0). Idempotent for one process group."""
    global _watchdog, _generation, _hooked
    seconds = watchdog_seconds(seconds)
    if not dist.is_initialized():
        raise RuntimeError("watch_ranks needs the process group: call torch.distributed.init_process_group first")
    if _watchdog is not None:
        if _watchdog.group is dist.group.WORLD and not _watchdog._stop.is_set():
            return _watchdog
        _watchdog.stop()
        _watchdog = None
    if seconds == 0 or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    _generation += 1
    _watchdog = RankWatchdog(store, dist.get_rank(), dist.get_world_size(), seconds, _generation)
    if not _hooked:
        _hooked = True
        previous = sys.excepthook

        def excepthook(kind, error, tb):
            global _uncaught
            _uncaught = True
            lost = None
            if _watchdog is not None and not issubclass(kind, KeyboardInterrupt):
                # A collective's error (gloo's are RuntimeErrors) may come before the peer is seen gone: wait a
                # little for it; any other error is looked at once.
                wait = min(_GRACE_S, _watchdog.seconds) if issubclass(kind, RuntimeError) else 0.0
                lost = _watchdog.find_lost(wait=wait)
            if lost is None:
                return previous(kind, error, tb)
            named = RankLostError(lost)
            named.__cause__ = error
            _watchdog.stop()  # the message is out: no need for the watchdog to end the process
            return previous(RankLostError, named, None)

        sys.excepthook = excepthook
        atexit.register(_leave_at_exit)
    return _watchdog


def _leave_at_exit() -> None:
    if _watchdog is not None and not _uncaught:
        _watchdog.leave()


# -- what Megatron's DDP / finalize_model_grads would do, for a model without that wrapper ----------------

def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> int:
    """Sum, over the TP group, the grads of params tagged `.sequence_parallel` (norms, RowParallel biases):
    under SP each rank saw only its sequence shard. Megatron does this in finalize_model_grads
    (distributed/finalize_model_grads.py:354), which needs its DDP. Returns how many grads were reduced."""
    from megatron.core import parallel_state

    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:  # no SP (nothing is tagged without it)
        return 0
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return 0
    flat = torch._utils._flatten_dense_tensors(grads)  # one collective for all, as Megatron does
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)
    return len(grads)


def gather_tensor_parallel(tensor: torch.Tensor, like: torch.nn.Parameter) -> torch.Tensor:
    """The full (TP=1) tensor from this rank's shard `tensor` of param `like` (its weight or its grad).

    Megatron splits a master weight along `partition_dim` into `world * stride` chunks and gives rank r the
    chunks r, r + world, ... (tensor_parallel/layers.py:179-188; stride 2 for GLU's [gate, up]); this undoes it.
    """
    from megatron.core import parallel_state

    if not getattr(like, "tensor_model_parallel", False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    world, dim, stride = group.size(), like.partition_dim, like.partition_stride
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    chunks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([chunks[i % world][i // world] for i in range(world * stride)], dim=dim)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> full (TP=1 shaped) grad of every parameter; names as in the eager model (no `_orig_mod.`)."""
    return {
        name.removeprefix("_orig_mod."): gather_tensor_parallel(p.grad, p)
        for name, p in model.named_parameters()
    }


# -- launcher ----------------------------------------------------------------------------------------------

def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh Python processes and return each rank's result, rank order.

    `fn` must be a module-level function of an importable module or file (not `__main__`); it runs with
    $RANK, $WORLD_SIZE and $NPU_COMPILE_STORE (a FileStore path) set and one CPU thread, and calls
    init_distributed itself. Arguments and results travel by pickle. On the first failing rank the others are
    killed and its traceback is raised; past `timeout` seconds all are killed.
    """
    if fn.__module__ == "__main__":
        raise ValueError(f"run_on_ranks needs {fn.__qualname__} in an importable module, not in __main__")
    with tempfile.TemporaryDirectory(prefix="megatron_glue_ranks_") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump(((fn.__module__, fn.__qualname__, inspect.getfile(fn)), args), f)
        env = dict(
            os.environ,
            WORLD_SIZE=str(world_size),
            NPU_COMPILE_STORE=os.path.join(tmp, "store"),
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),  # what this process can import, the ranks can
            OMP_NUM_THREADS="1",  # the ranks share this host's cores
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host: do not resolve its name
        command = [sys.executable, "-c", "from megatron_glue.capture.distributed import _rank_main; _rank_main()", tmp]
        ranks = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in ranks]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break  # all done, or one failed: the others may wait for it for ever
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__qualname__} on {world_size} ranks ran past {timeout:.0f} s")
                time.sleep(0.2)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                p.wait()
        for r in failed:  # the ranks that failed by themselves, not those killed here after
            error = os.path.join(tmp, f"rank{r}.error")
            detail = open(error).read() if os.path.exists(error) else f"exit code {ranks[r].returncode}"
            raise RuntimeError(f"{fn.__qualname__} failed on rank {r} of {world_size}:\n{detail}")
        results = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def worker_store() -> dist.Store:
    """In a run_on_ranks worker: the rendezvous store shared by its ranks."""
    return dist.FileStore(os.environ["NPU_COMPILE_STORE"], int(os.environ["WORLD_SIZE"]))


def end_process_group() -> None:
    """Destroy the process group (and Megatron's parallel state, which holds its subgroups), then let go of the
    GIL for a moment before the interpreter ends. A gloo worker thread releases each finished collective's tensors
    after the caller's wait has returned, and that release takes the GIL (the tensors' Python objects); one still
    waiting for the GIL when the interpreter finalizes is unwound there, and the C++ runtime aborts the process
    ("terminate called without an active exception", exit -6) after a clean run."""
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(0.1)  # GIL released: the waiting worker threads finish


def _rank_main() -> None:
    """A run_on_ranks process: run the job, leave its result (or traceback) in the job folder."""
    tmp, rank = sys.argv[1], int(os.environ["RANK"])
    torch.set_num_threads(1)
    try:
        with open(os.path.join(tmp, "job.pkl"), "rb") as f:
            where, args = pickle.load(f)
        result = _find(*where)(*args)
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)
    finally:
        end_process_group()


def _find(module_name: str, qualname: str, path: str) -> Callable[..., Any]:
    """The function `qualname` of the module, imported by name or, failing that (e.g. a pytest file), by path."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target
