"""Reference batches: batches whose data stays in storage. `access` resolves URIs and says who may
use them, `tables` plans, reads and writes the data (Parquet, CSV, JSONL), `chunks` keeps the chunk rows (the
unit a worker claims) and the manifest."""
