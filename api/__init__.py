"""HTTP side of the job service: the FastAPI app, routes, dependencies, auth, errors and /metrics (the data layer
is store/)."""
