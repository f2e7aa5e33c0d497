"""Runs torch's FSDP2 unit tests on CPU (gloo), optionally with fsdp-rs in
place of FSDP2 (see README.md). Loaded by every Python process that has this
directory on ``PYTHONPATH``: the pytest process and each spawned rank.

FSDP_IMPL=torch: torch's own FSDP2, with the CPU patches below only;
FSDP_IMPL=fsdprs: also fsdp-rs substituted for FSDP2's public names.
"""

import os
import sys

_IMPL = os.environ.get("FSDP_IMPL", "")
_MAX_WS = int(os.environ.get("FSDP_MAX_WORLD_SIZE", "2"))


def _apply():
    import functools

    import torch

    # ---- 1. device count: pretend the CPU "device module" has _MAX_WS devices
    #      so `min(N, torch.get_device_module("cpu").device_count())` -> 2.
    torch.cpu.device_count = lambda: _MAX_WS
    # tests that size their world by torch.accelerator.device_count() (the
    # extensions file's multi-thread tests) ran with no ranks on CPU
    if hasattr(torch, "accelerator"):
        torch.accelerator.device_count = lambda: _MAX_WS

    import torch.testing._internal.common_distributed as cd

    # ---- 2. skip_if_lt_x_gpu: run on CPU if x <= _MAX_WS, else skip.
    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        def decorator(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                if x <= _MAX_WS:
                    return func(*args, **kwargs)
                test_skip = cd.TEST_SKIPS[f"multi-gpu-{x}"]
                if not cd._maybe_handle_skip_if_lt_x_gpu(args, test_skip.message):
                    sys.exit(test_skip.exit_code)

            return wrapper

        return decorator

    cd.skip_if_lt_x_gpu = skip_if_lt_x_gpu
    # NCCL-version gates are meaningless on gloo: run the test.
    cd.requires_nccl_version = lambda version, msg: lambda f: f

    # ---- 3. world size capped at _MAX_WS for every multi-process / multi-thread test
    def _cap_world_size(cls):
        prop = cls.__dict__.get("world_size")
        if isinstance(prop, property) and not getattr(prop.fget, "_capped", False):
            orig = prop.fget

            def fget(self, _orig=orig):
                return min(_MAX_WS, _orig(self))

            fget._capped = True
            cls.world_size = property(fget)
        elif isinstance(prop, int):
            cls.world_size = min(_MAX_WS, prop)

    # Every subclass defined later (i.e. in test modules) gets its
    # `world_size` property wrapped at class-creation time.
    for base in (cd.MultiProcessTestCase, cd.MultiThreadedTestCase):
        _cap_world_size(base)
        base.__init_subclass__ = classmethod(lambda cls, **kw: _cap_world_size(cls))

    import torch.testing._internal.common_fsdp as cf

    _cap_world_size(cf.FSDPTest)
    _cap_world_size(cf.FSDPTestMultiThread)
    # FSDPTest._run exits ("multi-gpu-N" skip) when accelerator count < world
    # size; the mixin's _run has the CPU exemption -> use it.
    cf.FSDPTest._run = classmethod(cf.FSDPTestMixin._run.__func__)
    cf.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    # ---- 4. DDP/replicate reference models: tests pass device_ids=[rank],
    #      which DDP rejects for CPU modules. Drop device_ids for CPU modules.
    import torch.nn.parallel.distributed as ddp_mod

    _orig_ddp_init = ddp_mod.DistributedDataParallel.__init__

    def _ddp_init(self, module, device_ids=None, output_device=None, *a, **kw):
        try:
            devs = {p.device.type for p in module.parameters()}
        except Exception:
            devs = set()
        if devs <= {"cpu", "meta"}:
            device_ids, output_device = None, None
        return _orig_ddp_init(self, module, device_ids, output_device, *a, **kw)

    ddp_mod.DistributedDataParallel.__init__ = _ddp_init

    if _IMPL != "fsdprs":
        return

    # ---- 5. substitute fsdp_rs for FSDP2's public names: the supported switch
    #      (fsdp_rs/switch.py), in the three places clients import them from
    import fsdp_rs

    fsdp_rs.patch_fsdp2()
    os.environ["FSDP_RS_SUBSTITUTED"] = "1"


try:
    _apply()
except Exception as e:  # pragma: no cover
    print(f"[fsdp harness] patch failed: {type(e).__name__}: {e}", file=sys.stderr)
    raise
