"""inkling_mtp: the `inkling-mtp` command line over both engines (cli.py)."""
