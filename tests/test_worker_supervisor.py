"""`packscore worker --devices` (issue 38): one ordinary worker process per group of TENSOR_PARALLEL chips,
each given its chips through the platform's own variables; a SIGKILLed worker is started again and the job it
held runs once; SIGINT stops every worker within the stop time.

The chips are counted from device files, never opened, so the supervisor runs here, on a host with no
accelerator, as on a TPU host: `--platform tpu --chips 2`. Its workers' JAX stays on the CPU (JAX_PLATFORMS=cpu
from the test environment); the TPU variables they were given are read from their own /proc/<pid>/environ.
"""

import ctypes.util
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from packscore.supervisor import WORKER_STOP_SECONDS, Chips, DeviceError, detect, device_groups
from tests.service_harness import Service, assert_exactly_once, running_service, wait_until

TPU_VARIABLES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_PORT",
                 "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID", "DEVICE_GROUP")


# ---- which chips and variables each worker gets (no processes) ----------------------------------------------

def test_tpu_groups_get_the_variables_vllm_sets_per_rank() -> None:
    v6e8 = Chips("tpu", tuple(map(str, range(8))))
    groups, left = device_groups(v6e8, tensor_parallel=1)
    assert [g.name for g in groups] == [f"tpu:{i}" for i in range(8)] and left == ()
    assert groups[3].env == {"DEVICE_GROUP": "tpu:3", "TPU_VISIBLE_CHIPS": "3", "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                             "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": "8479",
                             "TPU_PROCESS_ADDRESSES": "localhost:8479", "CLOUD_TPU_TASK_ID": "0"}
    groups, _ = device_groups(v6e8, tensor_parallel=4)
    assert [(g.env["TPU_VISIBLE_CHIPS"], g.env["TPU_CHIPS_PER_PROCESS_BOUNDS"], g.env["TPU_PROCESS_PORT"])
            for g in groups] == [("0,1,2,3", "1,4,1", "8476"), ("4,5,6,7", "1,4,1", "8477")]
    # A worker that takes every chip of the host leaves the runtime its defaults.
    groups, _ = device_groups(v6e8, tensor_parallel=8)
    assert [g.env for g in groups] == [{"DEVICE_GROUP": "tpu:0,1,2,3,4,5,6,7"}]
    with pytest.raises(DeviceError, match="groups of 1, 2, 4, 8 chips"):
        device_groups(v6e8, tensor_parallel=3)
    with pytest.raises(DeviceError, match="needs 4 tpu chips per worker; 2 are given"):
        device_groups(v6e8, tensor_parallel=4, devices=2)


def test_v7x_chips_hold_two_devices_each() -> None:
    chips = detect("tpu", 4, environ={"TPU_ACCELERATOR_TYPE": "tpu7x-8"})
    assert chips.devices_per_chip == 2
    groups, _ = device_groups(chips, tensor_parallel=4)  # 4 devices: 2 chips per worker
    assert [(g.env["TPU_VISIBLE_CHIPS"], g.env["TPU_CHIPS_PER_PROCESS_BOUNDS"]) for g in groups] == \
        [("0,1", "1,2,1"), ("2,3", "1,2,1")]
    assert detect("tpu", 4, environ={"TPU_ACCELERATOR_TYPE": "v6e-8"}).devices_per_chip == 1
    assert detect("tpu", 4, environ={"TPU_ACCELERATOR_TYPE": "v5litepod-4"}).devices_per_chip == 1


def test_gpu_and_cpu_groups() -> None:
    gpus = detect(environ={"CUDA_VISIBLE_DEVICES": "2,3,5,7"})  # those the supervisor was given
    assert gpus == Chips("cuda", ("2", "3", "5", "7"))
    groups, left = device_groups(gpus, tensor_parallel=2)
    assert [g.env for g in groups] == [{"DEVICE_GROUP": "cuda:2,3", "CUDA_VISIBLE_DEVICES": "2,3"},
                                       {"DEVICE_GROUP": "cuda:5,7", "CUDA_VISIBLE_DEVICES": "5,7"}] and left == ()
    groups, left = device_groups(gpus, tensor_parallel=2, devices=3)
    assert [g.name for g in groups] == ["cuda:2,3"] and left == ("5",)
    with pytest.raises(DeviceError, match="--devices 5: this host has 4 cuda chips"):
        device_groups(gpus, tensor_parallel=1, devices=5)
    # CPU: each worker's share of host devices, the other XLA flags kept.
    groups, _ = device_groups(Chips("cpu", ("0", "1", "2", "3")), tensor_parallel=2,
                              environ={"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"})
    assert [g.env for g in groups] == [
        {"DEVICE_GROUP": f"cpu:{ids}", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"} for ids in ("0,1", "2,3")]


def test_chips_are_found_from_device_files(tmp_path: Path) -> None:
    tpu_env = {"TPU_ACCELERATOR_TYPE": "v6e-8"}
    assert detect(root=tmp_path, environ={}) == Chips("cpu", ("0",))
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    for name in ("vfio", "0", "1", "2", "3"):  # v5e/v6e: a VFIO group per chip, beside the control file
        (tmp_path / "dev" / "vfio" / name).touch()
    assert detect(root=tmp_path, environ=tpu_env) == Chips("tpu", ("0", "1", "2", "3"))
    for i in range(8):  # v4/v5p: /dev/accelN
        (tmp_path / "dev" / f"accel{i}").touch()
    assert detect(root=tmp_path, environ=tpu_env).ids == tuple(map(str, range(8)))
    for address in ("0000:00:04.0", "0000:00:05.0"):
        (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / address).mkdir(parents=True)
    assert detect(root=tmp_path, environ={}) == Chips("cuda", ("0", "1"))
    assert detect("tpu", root=tmp_path, environ=tpu_env).ids == tuple(map(str, range(8)))
    assert detect("tpu", 2, root=tmp_path, environ=tpu_env).ids == ("0", "1")


def test_chips_that_do_not_split_are_a_one_line_error() -> None:
    result = subprocess.run([sys.executable, "-m", "packscore.cli", "worker", "--devices", "all", "--platform", "tpu",
                             "--chips", "2"],
                            env={**os.environ, "TENSOR_PARALLEL": "4", "TPU_ACCELERATOR_TYPE": "v5litepod-8"},
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr.strip()) == (
        1, "packscore worker: TENSOR_PARALLEL=4 needs 4 tpu chips per worker; 2 are given")


def test_workers_are_started_on_jemalloc_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from packscore.cli import worker_allocator_environment
    from store.settings import get_settings

    library = ctypes.util.find_library("jemalloc")
    variables, said = worker_allocator_environment({})
    if library is None:
        assert variables == {} and "no libjemalloc here" in said
    else:
        assert variables == {"LD_PRELOAD": library, "ARROW_DEFAULT_MEMORY_POOL": "system",
                             "PYTHONMALLOC": "malloc"} and library in said
        # An operator's choice for Arrow's pool or Python's objects (pymalloc_debug, say) is kept.
        variables, said = worker_allocator_environment({"PYTHONMALLOC": "pymalloc",
                                                        "ARROW_DEFAULT_MEMORY_POOL": "jemalloc"})
        assert (variables["PYTHONMALLOC"], variables["ARROW_DEFAULT_MEMORY_POOL"]) == ("pymalloc", "jemalloc")
        assert "PYTHONMALLOC=pymalloc" in said
    # An LD_PRELOAD already given (tcmalloc, a profiler) is the operator's: kept, nothing added.
    variables, said = worker_allocator_environment({"LD_PRELOAD": "libtcmalloc.so.4"})
    assert variables == {} and said == "LD_PRELOAD=libtcmalloc.so.4 (as set)"
    monkeypatch.setenv("WORKER_ALLOCATOR", "system")
    get_settings.cache_clear()
    try:
        assert worker_allocator_environment({}) == ({}, "the system's")
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


# ---- the supervisor and its workers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def supervised(redis_url: str, run_id: str, database_factory,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, subprocess.Popen, str]]:  # type: ignore[no-untyped-def]
    """An API, and `packscore worker --devices all` on a host of two TPU chips (as the test says), both ready."""
    name = f"packscore_supervisor_{run_id}"
    # MODEL_CACHE_DIR and COMPILE_CACHE_DIR are the run's (tests/conftest.py): a restarted worker loads the
    # programs its predecessor compiled.
    with database_factory(name) as url, running_service(
            {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:{name}:", "WARMUP": "none"},
            tmp_path_factory.mktemp("supervisor")) as service:
        supervisor = service.cli("worker", "--devices", "all", "--platform", "tpu", "--chips", "2",
                                 log="supervisor.log", env={"TPU_ACCELERATOR_TYPE": "v6e-8"})
        service.workers.append(supervisor)  # stopped at the end if a test did not
        service.wait_for_workers(2, seconds=120)
        yield service, supervisor, url


def _workers(url: str) -> dict[int, str | None]:
    """pid -> device group of the workers registered (alive or not yet stale)."""
    engine = create_engine(url)
    try:
        with engine.connect() as db:
            rows = db.execute(text("SELECT id, device_group FROM workers")).all()
    finally:
        engine.dispose()
    return {int(worker_id.split(":")[1]): group for worker_id, group in rows}


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_each_worker_gets_its_own_chips(supervised: tuple[Service, subprocess.Popen, str]) -> None:
    service, supervisor, url = supervised
    workers = {pid: group for pid, group in _workers(url).items() if _alive(pid)}
    assert sorted(workers.values()) == ["tpu:0", "tpu:1"], workers
    for pid, group in workers.items():
        assert _parent(pid) == supervisor.pid
        chip = group.split(":")[1]
        port = str(8476 + int(chip))
        assert {k: _environ(pid).get(k) for k in TPU_VARIABLES} == {
            "TPU_VISIBLE_CHIPS": chip, "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_PROCESS_PORT": port, "TPU_PROCESS_ADDRESSES": f"localhost:{port}", "CLOUD_TPU_TASK_ID": "0",
            "DEVICE_GROUP": group}
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "jaxlib" in maps  # a worker runs JAX...
        # ...on jemalloc where the host has it (WORKER_ALLOCATOR's default: glibc's RSS grew 2-3x faster).
        assert ("/libjemalloc" in maps) == (ctypes.util.find_library("jemalloc") is not None), _environ(pid)
        # ...Python's objects with it (docs/soak.md: its own arenas fragmented under a big batch's rows).
        jemalloc = ctypes.util.find_library("jemalloc") is not None
        assert _environ(pid).get("PYTHONMALLOC") == ("malloc" if jemalloc else None)
    # ...the supervisor never does (it would hold every chip of a TPU host), and keeps glibc's allocator.
    maps = Path(f"/proc/{supervisor.pid}/maps").read_text()
    assert "jaxlib" not in maps and "/libjemalloc" not in maps

    ready = httpx.get(f"{service.base_url}/readyz", timeout=10).json()
    assert sorted((g["device_group"], g["state"]) for g in ready["device_groups"]) == [("tpu:0", "ready"),
                                                                                      ("tpu:1", "ready")]
    assert {g["host"] for g in ready["device_groups"]} == {os.uname().nodename}
    metrics = httpx.get(f"{service.base_url}/metrics", timeout=10).text
    for group in ("tpu:0", "tpu:1"):
        assert (f'packscore_device_group_workers{{device_group="{group}",host="{os.uname().nodename}",'
                f'model="tiny-random",state="ready"}} 1.0') in metrics


def test_a_killed_worker_is_started_again_and_its_job_runs_once(
        supervised: tuple[Service, subprocess.Popen, str]) -> None:
    service, supervisor, url = supervised
    tag = uuid.uuid4().hex
    body = {"query": "Rank these candidates by relevance to the question asked.",
            "items": [f"candidate {i} says {i % 13} things" for i in range(4000)], "label_token_ids": [5, 17],
            "metadata": {"load_tag": tag}}
    with service.http() as client:
        response = client.post("/jobs", json=body)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        engine = create_engine(url)

        def job() -> tuple[str, str | None, int]:
            with engine.connect() as db:
                return tuple(db.execute(text("SELECT status, lease_owner, attempts FROM jobs WHERE id = :id"),
                                        {"id": job_id}).one())

        wait_until(lambda: job()[0] == "running", 60, "the job to start", interval=0.02)
        owner = job()[1]
        held = int(owner.split(":")[1])
        # Frozen, it keeps the job (it can write nothing more) until it is killed.
        os.kill(held, signal.SIGSTOP)
        assert job()[:2] == ("running", owner), "the job finished before its worker could be held"
        group = _workers(url)[held]
        os.kill(held, signal.SIGKILL)

        def replaced() -> bool:
            return any(g == group and pid != held and _alive(pid) for pid, g in _workers(url).items())

        wait_until(replaced, 120, f"a new worker for {group}")
        new = next(pid for pid, g in _workers(url).items() if g == group and pid != held and _alive(pid))
        assert _parent(new) == supervisor.pid and _environ(new)["TPU_VISIBLE_CHIPS"] == group.split(":")[1]
        wait_until(lambda: job()[0] in ("succeeded", "failed", "cancelled"), 120, "the job to end")
        status, _, attempts = job()
        engine.dispose()
    assert (status, attempts) == ("succeeded", 2)
    assert_exactly_once(url, [job_id], tag)
    assert f"worker {group} failed (exit code -9)" in (service.logs / "supervisor.log").read_text()


def test_a_worker_stopped_from_outside_is_started_again(supervised: tuple[Service, subprocess.Popen, str]) -> None:
    """A SIGTERM to one worker alone (earlyoom, an operator's kill) stops it cleanly, exit 0, which the supervisor
    took for a stop on purpose and left it so: a host of fewer workers, or in embedded mode none, while the API
    kept accepting jobs."""
    service, supervisor, url = supervised
    wait_until(lambda: sum(_alive(pid) for pid in _workers(url)) == 2, 120, "two live workers")
    stopped = next(pid for pid in _workers(url) if _alive(pid))
    group = _workers(url)[stopped]
    os.kill(stopped, signal.SIGTERM)
    wait_until(lambda: any(g == group and pid != stopped and _alive(pid) for pid, g in _workers(url).items()), 120,
               f"a new worker for {group}")
    assert not _alive(stopped) and supervisor.poll() is None
    assert f"worker {group} stopped without its supervisor stopping" in (service.logs / "supervisor.log").read_text()


def test_sigint_stops_every_worker_within_the_stop_time(supervised: tuple[Service, subprocess.Popen, str]) -> None:
    service, supervisor, url = supervised
    wait_until(lambda: sum(_alive(pid) for pid in _workers(url)) == 2, 120, "two live workers")
    children = [pid for pid in _workers(url) if _alive(pid)]
    signalled = time.monotonic()
    supervisor.send_signal(signal.SIGINT)
    assert supervisor.wait(timeout=WORKER_STOP_SECONDS + 10) == 0
    took = time.monotonic() - signalled
    assert took < WORKER_STOP_SECONDS + 2, f"stopping took {took:.1f} s"
    assert not any(_alive(pid) for pid in children)
    # Each stopped cleanly (a killed one would have left its row until it went stale).
    assert not set(children) & set(_workers(url))


def test_workers_stop_when_their_supervisor_is_killed(supervised: tuple[Service, subprocess.Popen, str]) -> None:
    """Started with a plain Popen, the workers of a SIGKILLed supervisor ran on (their parent now init), holding
    their chips and taking jobs beside the workers of the supervisor started again. Each watches its parent."""
    service, _, url = supervised
    supervisor = service.cli("worker", "--devices", "all", "--platform", "cpu", "--chips", "1",
                             log="supervisor-killed.log")
    service.workers.append(supervisor)
    wait_until(lambda: any(_alive(pid) and _parent(pid) == supervisor.pid for pid in _workers(url)), 120,
               "the supervisor's worker")
    worker = next(pid for pid in _workers(url) if _alive(pid) and _parent(pid) == supervisor.pid)
    supervisor.kill()
    supervisor.wait()
    wait_until(lambda: not _alive(worker), WORKER_STOP_SECONDS + 10, "the orphaned worker to stop")
    assert worker not in _workers(url)  # a clean stop: it deregistered
