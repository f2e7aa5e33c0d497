"""The package as users get it: build the wheel the way ``pip install .`` does,
install it into a fresh virtualenv and import every module from there."""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The PEP 517 path `pip install .` takes, without build isolation so that
    # the pinned maturin of this environment builds it.
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-q", "-w", str(out), str(ROOT)], check=True)
    (built,) = out.glob("fsdp_rs-*.whl")
    return built


def test_wheel_is_abi3_and_ships_the_package(wheel: Path):
    assert "-abi3-" in wheel.name, wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in [
        "fsdp_rs/__init__.py",
        "fsdp_rs/_core.pyi",
        "fsdp_rs/py.typed",
        "fsdp_rs/kernels/__init__.py",
        "fsdp_rs/kernels/all_gather_copy_out.py",
        "fsdp_rs/ops/__init__.py",
        "fsdp_rs/planning/reference.py",
        "fsdp_rs/bench/__main__.py",
        "fsdp_rs_switch.pth",  # FSDP_RS=1 ([Note: The switch] in fsdp_rs/switch.py)
    ]:
        assert expected in names, f"{expected} missing from {wheel.name}"
    assert any(n.startswith("fsdp_rs/_core.") and n.endswith(".so") for n in names)
    # The top-level `kernels` symlink is for the source tree only: a top-level
    # `kernels` package would clash with the PyPI project of that name.
    assert not any(n.startswith("kernels/") for n in names)


def test_fresh_venv_imports_the_installed_wheel(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # torch and numpy come from this environment (a .pth file), so the test
    # does not download gigabytes; fsdp-rs itself comes only from the wheel.
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    script = (
        "import sys\n"
        "import fsdp_rs, fsdp_rs._core, fsdp_rs.kernels, fsdp_rs.ops, fsdp_rs.planning\n"
        "import torch\n"
        "assert torch.ops.fsdp_rs.post_reduce.default\n"
        "import numpy as np\n"
        "assert fsdp_rs.__file__.startswith(sys.argv[1]), fsdp_rs.__file__\n"
        "plan = fsdp_rs.plan_group(np.array([2], np.int64), np.array([5, 3], np.int64), 2, 1)\n"
        "assert plan.sharded_sizes.tolist() == [2, 3]\n"
        "print(fsdp_rs.__version__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [python, "-c", script, str(env_dir)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == fsdp_rs_version()
    # The installed switch: FSDP_RS=1 gives a client importing FSDP2's names
    # fsdp-rs's, with no code changed; unset, Python starts without torch.
    client = (
        "import sys\n"
        "assert 'torch' not in sys.modules\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "import fsdp_rs\n"
        "print(fully_shard is fsdp_rs.fully_shard)\n"
    )
    for value, expected in (("1", "True"), ("0", "False")):
        done = subprocess.run(
            [python, "-c", client],
            cwd=tmp_path,
            env={**env, "FSDP_RS": value},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, (value, done.stdout)


def fsdp_rs_version() -> str:
    cargo = (ROOT / "Cargo.toml").read_text()
    line = next(ln for ln in cargo.splitlines() if ln.startswith("version"))
    return line.split('"')[1]
