"""The data layer: tables and sessions, the job queue (submit, claim, lease, finish, sweep, cancel), batch ingest
and results, counters, retention, the webhook outbox, the settings, and the broker's kick. The API (api/) and
the workers (worker/) both build on it and never import each other."""
