"""HTTP side of the job service: FastAPI app, routes, settings, tables."""
