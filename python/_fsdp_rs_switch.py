"""``FSDP_RS=1``: what ``fsdp_rs_switch.pth`` runs at Python's start-up where
the variable is set ([Note: The switch] in ``fsdp_rs/switch.py``). Kept out of
the ``fsdp_rs`` package, whose import loads numpy and the planner: here only an
import hook is registered, and fsdp-rs loads when torch's FSDP2 does."""

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "FSDP_RS"
_TRIGGER = "torch.distributed.fsdp"


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


class SwitchOnImport(importlib.abc.MetaPathFinder):
    """Switches once ``torch.distributed.fsdp`` has run, before its importer
    reads a name from it; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from fsdp_rs.switch import patch_fsdp2

            patch_fsdp2()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Switch now if torch's FSDP2 is imported, else when it is."""
    if not enabled():
        return
    if _TRIGGER in sys.modules:
        from fsdp_rs.switch import patch_fsdp2

        patch_fsdp2()
    elif not any(isinstance(f, SwitchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, SwitchOnImport())
