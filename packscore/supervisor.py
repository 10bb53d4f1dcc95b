"""`packscore worker --devices all|N`: one ordinary worker process per group of TENSOR_PARALLEL chips of this
host, each given its chips through the platform's own variables, started again when it fails, all stopped on
SIGTERM/SIGINT. `serve --embedded` keeps its one worker with the same supervisor.

The supervisor never starts JAX (a process that opened the TPU chips would hold them all): it counts chips from
the device files the drivers make, and each child's runtime sees only the chips in its variables:
- TPU: `TPU_VISIBLE_CHIPS`, `TPU_CHIPS_PER_PROCESS_BOUNDS`, `TPU_PROCESS_BOUNDS`, and a libtpu port of its own
  (`TPU_PROCESS_PORT`, `TPU_PROCESS_ADDRESSES`, `CLOUD_TPU_TASK_ID`), as vLLM's TPU backend sets them for each
  of its data-parallel ranks; a group that takes every chip of the host gets none (the runtime's defaults).
- NVIDIA GPUs: `CUDA_VISIBLE_DEVICES`.
- CPU (tests, and trying TENSOR_PARALLEL without an accelerator): `JAX_PLATFORMS=cpu` and XLA's host device
  count in `XLA_FLAGS`.
Each child also gets `DEVICE_GROUP` ("tpu:0,1,2,3"), which its heartbeat records for /readyz and /metrics.
"""

import glob
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PLATFORMS = ("tpu", "cuda", "cpu")
# libtpu's default TPU_PROCESS_PORT; the worker of group i listens on the next i ports (vLLM's TPU backend does too).
TPU_BASE_PORT = 8476
# The sub-slices a TPU host splits into (chips per process).
TPU_GROUP_CHIPS = (1, 2, 4, 8)
# TPU generations whose chips show JAX two devices (two TensorCores, no megacore): v2, v3 and v7x (Ironwood).
TWO_DEVICE_TPUS = re.compile(r"^(tpu-?)?v?[237](?!\d)")
GCE_ACCELERATOR_TYPE = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"
# Seconds the workers get to finish the pass in flight and hand their other jobs back, once asked to stop.
WORKER_STOP_SECONDS = 8.0
# A failed worker is started again after 1 s, then 2, 4, ... up to a minute while it keeps failing; one that ran
# for STABLE_SECONDS before failing starts again after 1 s.
BACKOFF_SECONDS = (1.0, 60.0)
STABLE_SECONDS = 60.0
POLL_SECONDS = 0.5


class DeviceError(Exception):
    """Chips that cannot be split as asked (the message says why and what would work)."""


@dataclass(frozen=True)
class Chips:
    """A host's chips: the platform, their ids as its variables name them, and JAX devices per chip."""

    platform: str
    ids: tuple[str, ...]
    devices_per_chip: int = 1


@dataclass(frozen=True)
class DeviceGroup:
    """The chips of one worker: its name (for /readyz and /metrics) and the variables that give them to it."""

    name: str
    env: dict[str, str] = field(default_factory=dict)


def _tpu_chip_count(root: Path) -> int:
    # /dev/accel0.. on v4 and v5p TPU VMs; VFIO groups /dev/vfio/0.. on v5e, v6e and later.
    accel = glob.glob(str(root / "dev" / "accel*"))
    if accel:
        return len(accel)
    vfio = root / "dev" / "vfio"
    return sum(entry.isdigit() for entry in os.listdir(vfio)) if vfio.is_dir() else 0


def _gpu_ids(root: Path, environ: Mapping[str, str]) -> tuple[str, ...]:
    # Those the supervisor was given, if any; else one per GPU the NVIDIA driver lists (without starting CUDA).
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(part.strip() for part in visible.split(",") if part.strip())
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    if gpus.is_dir():
        return tuple(str(i) for i in range(len(os.listdir(gpus))))
    if root == Path("/") and shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return tuple(str(i) for i in range(sum(line.startswith("GPU ") for line in listed.splitlines())))
    return ()


def _tpu_devices_per_chip(environ: Mapping[str, str]) -> int:
    """From the accelerator type (TPU_ACCELERATOR_TYPE, as GKE sets it, else the TPU VM's metadata server)."""
    kind = environ.get("TPU_ACCELERATOR_TYPE")
    if not kind:
        try:
            request = urllib.request.Request(GCE_ACCELERATOR_TYPE, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=2) as response:
                kind = response.read().decode()
        except OSError:
            print("packscore: TPU type unknown (no TPU_ACCELERATOR_TYPE, no metadata server): taking one JAX device "
                  "per chip", file=sys.stderr, flush=True)
            return 1
    return 2 if TWO_DEVICE_TPUS.match(kind.strip().lower()) else 1


def detect(platform: str | None = None, chips: int | None = None, root: Path = Path("/"),
           environ: Mapping[str, str] = os.environ) -> Chips:
    """This host's chips, found without opening them: NVIDIA GPUs (CUDA_VISIBLE_DEVICES, else the driver's
    list), else TPU chips (device files), else the CPU as one chip. `platform` and `chips` (a count) override
    what is found (hosts whose chips are not found, and tests)."""
    if platform not in (None, *PLATFORMS):
        raise DeviceError(f"unknown platform {platform!r}: one of {', '.join(PLATFORMS)}")
    gpus = _gpu_ids(root, environ) if platform in (None, "cuda") else ()
    tpus = _tpu_chip_count(root) if platform in (None, "tpu") and not gpus else 0
    found = platform or ("cuda" if gpus else "tpu" if tpus else "cpu")
    ids = gpus if found == "cuda" else tuple(map(str, range(tpus if found == "tpu" else 1)))
    if chips is not None:
        if chips < 1:
            raise DeviceError(f"--chips {chips}: at least 1")
        ids = ids[:chips] if found == "cuda" and len(ids) >= chips else tuple(map(str, range(chips)))
    if not ids:
        raise DeviceError(f"no {found} chips found on this host (--chips N says how many there are)")
    return Chips(found, ids, _tpu_devices_per_chip(environ) if found == "tpu" else 1)


def _xla_flags(existing: str, devices: int) -> str:
    flags = [flag for flag in existing.split() if not flag.startswith("--xla_force_host_platform_device_count=")]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def device_groups(chips: Chips, tensor_parallel: int, devices: int | None = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[list[DeviceGroup], tuple[str, ...]]:
    """One group per TENSOR_PARALLEL devices' worth of chips, among the first `devices` chips (None: all), and
    the chips left over. A group is contiguous and starts at a multiple of its size (TPU sub-slices must)."""
    per_group = math.ceil(tensor_parallel / chips.devices_per_chip)
    usable = chips.ids if devices is None else chips.ids[:devices]
    if devices is not None and devices > len(chips.ids):
        raise DeviceError(f"--devices {devices}: this host has {len(chips.ids)} {chips.platform} chips")
    if per_group > len(usable):
        raise DeviceError(f"TENSOR_PARALLEL={tensor_parallel} needs {per_group} {chips.platform} chips per worker; "
                          f"{len(usable)} are given")
    if chips.platform == "tpu" and per_group not in TPU_GROUP_CHIPS:
        fits = [n * chips.devices_per_chip for n in TPU_GROUP_CHIPS if n <= len(usable)]
        raise DeviceError(f"TENSOR_PARALLEL={tensor_parallel} needs {per_group} TPU chips per worker; a TPU host "
                          f"splits into groups of {', '.join(map(str, TPU_GROUP_CHIPS))} chips (TENSOR_PARALLEL "
                          f"{', '.join(map(str, fits))} here)")
    groups = []
    for rank, start in enumerate(range(0, len(usable) - per_group + 1, per_group)):
        ids = usable[start:start + per_group]
        name = f"{chips.platform}:{','.join(ids)}"
        env = {"DEVICE_GROUP": name}
        if chips.platform == "tpu" and len(ids) < len(chips.ids):
            port = TPU_BASE_PORT + rank
            env.update(TPU_VISIBLE_CHIPS=",".join(ids), TPU_CHIPS_PER_PROCESS_BOUNDS=f"1,{per_group},1",
                       TPU_PROCESS_BOUNDS="1,1,1", TPU_PROCESS_PORT=str(port),
                       TPU_PROCESS_ADDRESSES=f"localhost:{port}", CLOUD_TPU_TASK_ID="0")
        elif chips.platform == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        elif chips.platform == "cpu":
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(environ.get("XLA_FLAGS", ""), len(ids)))
        groups.append(DeviceGroup(name, env))
    left = usable[len(groups) * per_group:]
    return groups, left


def describe(chips: Chips, tensor_parallel: int, groups: list[DeviceGroup], left: tuple[str, ...]) -> list[str]:
    """The plan as `worker --devices` prints it: a summary line, then each worker's chips and variables."""
    lines = [f"{len(chips.ids)} {chips.platform} chips, TENSOR_PARALLEL={tensor_parallel}: {len(groups)} workers ("
             f"{', '.join(group.name for group in groups)})" + (f"; chips {','.join(left)} left idle" if left else "")]
    lines += [f"worker {i}: {group.name}  " + " ".join(f"{k}={v}" for k, v in group.env.items())
              for i, group in enumerate(groups)]
    return lines


@dataclass
class _Child:
    group: DeviceGroup
    command: list[str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0  # failures in a row, each within STABLE_SECONDS of its start (the backoff doubles)
    restart_at: float | None = None  # set while it waits out its backoff
    done: bool = False  # exited 0 while its supervisor was stopping (Ctrl-C reaches the children too)
    told_to_stop: bool = False  # sent SIGTERM (once: the warm shutdown it starts is not started twice)


class WorkerSupervisor:
    """Runs one worker per device group; `command(i)` is the command line of group i's worker."""

    def __init__(self, groups: list[DeviceGroup], command: Callable[[int], list[str]]) -> None:
        self._children = [_Child(group, command(i)) for i, group in enumerate(groups)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Whether this process was asked to stop (a signal its own handler took, before stop() is called).
        self._asked_to_stop: Callable[[], bool] = self._stopping.is_set

    def start(self) -> None:
        with self._lock:
            for child in self._children:
                self._start(child)

    def _start(self, child: _Child) -> None:
        # Its supervisor's pid: a worker whose supervisor died (SIGKILL, OOM) stops itself, not to hold its chips
        # (and take jobs) beside the workers of the supervisor started again.
        from worker.celery_app import SUPERVISOR_PID

        env = {**os.environ, **child.group.env, SUPERVISOR_PID: str(os.getpid())}
        child.process = subprocess.Popen(child.command, env=env)
        child.started, child.restart_at, child.told_to_stop = time.monotonic(), None, False
        if len(self._children) > 1 or child.group.env:
            print(f"packscore: worker {child.group.name} started (pid {child.process.pid})", file=sys.stderr,
                  flush=True)

    @staticmethod
    def _tell_to_stop(child: _Child) -> None:
        if child.process is not None and child.process.poll() is None and not child.told_to_stop:
            child.process.terminate()
            child.told_to_stop = True

    def check(self) -> bool:
        """One round: a worker that failed waits out its backoff, then starts again. Whether any worker runs or
        will run again."""
        now = time.monotonic()
        with self._lock:
            if self._stopping.is_set():
                return False
            if self._asked_to_stop():
                # Their warm shutdown starts now, beside the API's (`serve` signalled alone, as `pkill -f` does), so
                # that both end within the 10 s README promises.
                for child in self._children:
                    self._tell_to_stop(child)
            for child in self._children:
                if child.done:
                    continue
                if child.process is None:
                    if now >= child.restart_at:
                        self._start(child)
                    continue
                code = child.process.poll()
                if code is None:
                    continue
                if code == 0 and self._asked_to_stop():
                    print(f"packscore: worker {child.group.name} stopped", file=sys.stderr, flush=True)
                    child.done = True
                    continue
                # Exit 0 without this process stopping is a SIGTERM from outside (earlyoom, an operator's kill): it
                # starts again, or the API would accept jobs that nothing runs.
                why = f"failed (exit code {code})" if code else "stopped without its supervisor stopping"
                child.failures = child.failures + 1 if now - child.started < STABLE_SECONDS else 1
                delay = min(BACKOFF_SECONDS[0] * 2 ** (child.failures - 1), BACKOFF_SECONDS[1])
                print(f"packscore: worker {child.group.name} {why}; starting it again in {delay:.0f} s (its jobs run "
                      "again once their leases expire)", file=sys.stderr, flush=True)
                child.process, child.restart_at = None, now + delay
            return not all(child.done for child in self._children)

    def watch(self, asked_to_stop: Callable[[], bool]) -> None:
        """Checks the workers in a thread of its own until stop() (for `serve --embedded`, whose main thread
        runs the API). `asked_to_stop`: whether the process took a signal to stop (its workers exit 0 on it)."""
        self._asked_to_stop = lambda: self._stopping.is_set() or asked_to_stop()

        def loop() -> None:
            while not self._stopping.wait(POLL_SECONDS) and self.check():
                pass

        threading.Thread(target=loop, name="worker-watch", daemon=True).start()

    def run(self) -> None:
        """Starts the workers and checks them until SIGTERM or SIGINT, then stops them (`packscore worker
        --devices`); returns when all have stopped."""
        signalled = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: signalled.set())
        self._asked_to_stop = signalled.is_set
        self.start()
        while not signalled.wait(POLL_SECONDS) and self.check():
            pass
        self.stop()

    def stop(self) -> None:
        """Warm shutdown of every worker at once: each finishes the pass in flight and hands its other jobs back;
        those still running after WORKER_STOP_SECONDS are killed (their jobs run again once their leases expire)."""
        self._stopping.set()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
        with self._lock:
            running = [c for c in self._children if c.process is not None and c.process.poll() is None]
            for child in running:
                self._tell_to_stop(child)
            deadline = time.monotonic() + WORKER_STOP_SECONDS
            for child in running:
                try:
                    child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"packscore: worker {child.group.name} did not stop within {WORKER_STOP_SECONDS:.0f} s; "
                          "killing it (its jobs run again once their leases expire)", file=sys.stderr, flush=True)
                    child.process.kill()
                    child.process.wait()
