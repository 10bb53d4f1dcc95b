"""A job's priority (the `jobs.priority` column): the lane its creator puts it in, higher first.

The API and the batch store stamp these on the rows they create and the counters count by them; how the lanes
are ordered and served is the scheduling policy's (worker/policy.py). Plain values, no import: store and api
read them here, where worker cannot be imported.
"""

PRIORITY_SYNC = 10  # a /v1/score call: its connection waits for the job
PRIORITY_JOB = 0  # POST /jobs
PRIORITY_BATCH = -10  # a batch's requests (offline backfills)
