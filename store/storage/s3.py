"""Amazon S3 and S3-compatible stores (s3://, s3a://), through s3fs. Credentials come from the AWS chain on the
host (environment, profiles, instance roles), and AWS_ENDPOINT_URL names an S3-compatible store."""

import sys

from fsspec import AbstractFileSystem

from store.storage.interface import Failure, Store


class S3(Store):
    schemes = ("s3", "s3a")
    protocol = "s3"
    extra = None  # s3fs is a base dependency
    version_fields = ("ETag", "LastModified")

    def load(self, fs: AbstractFileSystem) -> None:
        fs.connect()  # botocore's client and its service model: no request

    def failure(self, exc: BaseException) -> Failure | None:
        # Looked up where botocore is loaded only: one of its exceptions means it is.
        botocore = sys.modules.get("botocore.exceptions")
        if botocore is not None:
            if isinstance(exc, botocore.ClientError) and _code(exc) == "NoSuchBucket":
                return Failure.NOT_FOUND
            if isinstance(exc, (botocore.NoCredentialsError, botocore.PartialCredentialsError,
                                botocore.CredentialRetrievalError, botocore.UnknownCredentialError,
                                botocore.ProfileNotFound)):
                return Failure.DENIED
            if isinstance(exc, botocore.ClientError) and _code(exc) in ("AccessDenied", "Forbidden", "403"):
                return Failure.DENIED
            if isinstance(exc, (botocore.ConnectionError, botocore.ConnectionClosedError,
                                botocore.ReadTimeoutError)):
                return Failure.UNREACHABLE
        return super().failure(exc)


def _code(exc: BaseException) -> str:
    """A botocore ClientError's error code ("NoSuchBucket", "AccessDenied", an HTTP status)."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
