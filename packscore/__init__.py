"""packscore command line (packscore.cli)."""
