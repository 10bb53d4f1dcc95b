"""Queue side of the job service: Celery app, drain/coalesce loop, leases, sweeper, webhook delivery."""
