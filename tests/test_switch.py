"""The switch for clients that call torch's FSDP2 themselves: ``FSDP_RS=1`` and
``fsdp_rs.patch_fsdp2()`` ([Note: The switch] in ``fsdp_rs/switch.py``). Each
case runs in a fresh interpreter: the switch changes torch's modules for the
rest of a process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the directory the wheel installs fsdp_rs_switch.pth into, as the source tree has it
SITE = ROOT / "python"
FAKE_PG = (
    "import torch.distributed as dist\n"
    "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
    "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
)


def _run(code: str, tmp_path: Path, fsdp_rs_env: str | None = None, site: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FSDP_RS"}
    if fsdp_rs_env is not None:
        env["FSDP_RS"] = fsdp_rs_env
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    # site.addsitedir runs the directory's .pth files, as Python's start-up
    # runs those of site-packages where the wheel put fsdp_rs_switch.pth
    prelude = f"import site; site.addsitedir({str(SITE)!r})\n" if site else ""
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(done.stderr[-4000:])
    return done.stdout.strip()


CLIENT = """
    # a library that imports FSDP2's names at its own import, as Lightning does
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch import nn

    def shard(model):
        for block in model:
            fully_shard(block)
        return fully_shard(model)
"""


def test_environment_switches_a_client_without_code_changes(tmp_path) -> None:
    (tmp_path / "client.py").write_text(textwrap.dedent(CLIENT))
    out = _run(
        FAKE_PG
        + """
import sys
import torch
import client
from torch import nn
import fsdp_rs
import torch.distributed.fsdp as public
import torch.distributed.fsdp._fully_shard as package
from torch.distributed.fsdp._fully_shard import _fully_shard as torchs_own
model = client.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
model(torch.randn(2, 4)).sum().backward()
print(client.fully_shard is fsdp_rs.fully_shard, isinstance(model[0], fsdp_rs.FSDPModule),
      public.register_fsdp_forward_method is fsdp_rs.register_fsdp_forward_method,
      package.fully_shard is fsdp_rs.fully_shard, torchs_own.fully_shard is not fsdp_rs.fully_shard)
""",
        tmp_path,
        fsdp_rs_env="1",
    )
    assert out == "True True True True True"


def test_old_import_path_switched(tmp_path) -> None:
    out = _run(
        """
from torch.distributed._composable.fsdp import fully_shard
import fsdp_rs
print(fully_shard is fsdp_rs.fully_shard)
""",
        tmp_path,
        fsdp_rs_env="1",
    )
    assert out == "True"


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_the_variable_nothing_changes_or_loads(tmp_path, value) -> None:
    out = _run(
        """
import sys
print("torch" in sys.modules, "fsdp_rs" in sys.modules)
from torch.distributed.fsdp import fully_shard
import fsdp_rs
print(fully_shard is fsdp_rs.fully_shard)
""",
        tmp_path,
        fsdp_rs_env=value,
    )
    assert out.split() == ["False", "False", "False"]


def test_patch_fsdp2_call_is_idempotent(tmp_path) -> None:
    out = _run(
        """
import fsdp_rs
fsdp_rs.patch_fsdp2()
fsdp_rs.patch_fsdp2()
import torch.distributed.fsdp as public
from fsdp_rs.switch import patched
print(public.fully_shard is fsdp_rs.fully_shard, public.FSDPModule is fsdp_rs.FSDPModule, patched())
""",
        tmp_path,
        site=False,
    )
    assert out == "True True True"


def test_switch_after_a_client_imported_torchs_names_raises(tmp_path) -> None:
    (tmp_path / "client.py").write_text(textwrap.dedent(CLIENT))
    out = _run(
        """
import client
import fsdp_rs
try:
    fsdp_rs.patch_fsdp2()
except RuntimeError as e:
    print(e)
""",
        tmp_path,
        site=False,
    )
    assert "came too late: client imported torch's fully_shard" in out, out


def test_switch_after_torch_sharded_a_module_raises(tmp_path) -> None:
    out = _run(
        FAKE_PG
        + """
from torch import nn
import torch.distributed.fsdp as public
public.fully_shard(nn.Linear(4, 4))
import fsdp_rs
try:
    fsdp_rs.patch_fsdp2()
except RuntimeError as e:
    print(e)
print(public.fully_shard is fsdp_rs.fully_shard)
""",
        tmp_path,
        site=False,
    )
    assert "torch's FSDP2 already sharded FSDPLinear" in out, out
    assert out.endswith("False")
