"""`python -m deploy ...` is `swaserve ...`."""

from deploy.cli import main

raise SystemExit(main())
