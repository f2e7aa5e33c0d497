"""``python -m fsdp_rs.bench``: see ``fsdp_rs.bench.cli``."""

from fsdp_rs.bench.cli import main

raise SystemExit(main())
