"""The `swaserve` command: the one package above every layer (`swaserve/cli.py`)."""
