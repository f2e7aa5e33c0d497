"""``python -m fsdp_rs.bench``: see ``fsdp_rs.bench.cli``."""

from fsdp_rs.bench.cli import main

if __name__ == "__main__":  # not when a spawned worker re-imports this module
    raise SystemExit(main())
