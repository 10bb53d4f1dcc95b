"""Google Cloud Storage (gs://, gcs://), through gcsfs (the `gcs` extra). Credentials come from Google's
application default chain on the host; STORAGE_EMULATOR_HOST names an emulator."""

import sys

from store.storage.interface import Failure, Store


class GCS(Store):
    schemes = ("gs", "gcs")
    protocol = "gcs"
    extra = "gcs"
    version_fields = ("generation", "etag", "mtime")

    def failure(self, exc: BaseException) -> Failure | None:
        # Each library looked up where it is loaded only: one of its exceptions means it is. gcsfs raises
        # google-auth's and google-api-core's errors, and aiohttp's, which it talks to the store with.
        auth = sys.modules.get("google.auth.exceptions")
        api = sys.modules.get("google.api_core.exceptions")
        aiohttp = sys.modules.get("aiohttp.client_exceptions")
        if api is not None and isinstance(exc, api.NotFound):
            return Failure.NOT_FOUND
        if (auth is not None and isinstance(exc, auth.DefaultCredentialsError)
                or api is not None and isinstance(exc, api.Forbidden)):
            return Failure.DENIED
        if (auth is not None and isinstance(exc, auth.TimeoutError)
                or api is not None and isinstance(exc, (api.ServiceUnavailable, api.GatewayTimeout))
                or aiohttp is not None and isinstance(exc, aiohttp.ClientConnectionError)):
            return Failure.UNREACHABLE
        return super().failure(exc)
