"""`python -m deploy serve ...` is `swaserve serve ...` (the serving layer's own entry; `bench`
lives above it, in `swaserve`)."""

from deploy.cli import main

raise SystemExit(main())
