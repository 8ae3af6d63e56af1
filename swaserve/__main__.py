"""`python -m swaserve ...` is `swaserve ...` (this checkout's code, whatever script is installed)."""

from swaserve.cli import main

raise SystemExit(main())
