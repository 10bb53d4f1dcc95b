"""Azure Blob Storage and Data Lake (az://, abfs://, abfss://), through adlfs (the `azure` extra). Credentials
come from the host: AZURE_STORAGE_CONNECTION_STRING, or an account name with azure-identity's chain."""

import sys

from store.storage.interface import Failure, Store


class Azure(Store):
    schemes = ("az", "abfs", "abfss")
    protocol = "az"
    extra = "azure"
    version_fields = ("etag", "last_modified")

    def failure(self, exc: BaseException) -> Failure | None:
        # Looked up where azure-core is loaded only: one of its exceptions means it is.
        azure = sys.modules.get("azure.core.exceptions")
        if azure is not None:
            if isinstance(exc, azure.ResourceNotFoundError):
                return Failure.NOT_FOUND
            if isinstance(exc, azure.ClientAuthenticationError):
                return Failure.DENIED
            if isinstance(exc, (azure.ServiceRequestError, azure.ServiceResponseError)):
                return Failure.UNREACHABLE
        return super().failure(exc)

    def refused_write(self, exc: BaseException) -> Failure | None:
        # azure-core raises a refused write as an HttpResponseError carrying the answer's status.
        azure = sys.modules.get("azure.core.exceptions")
        if azure is not None and isinstance(exc, azure.HttpResponseError) and exc.status_code == 403:
            return Failure.DENIED
        return super().refused_write(exc)
