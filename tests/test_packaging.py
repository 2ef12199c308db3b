"""The package as a user installs it: a wheel, not the editable checkout (issue 20: a hand-kept
package list once shipped a wheel without mlx_diloco.gym)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_every_package_and_runs_from_a_fresh_virtualenv(tmp_path):
    # Built from a copy of the files git knows: a build in the checkout leaves build/ behind, whose
    # stale modules later builds would ship.
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    source = tmp_path / "source"
    for name in listed:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_symlink():  # mlx_diloco/presets -> ../models
            (source / name).symlink_to(os.readlink(ROOT / name))
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("mlx_diloco-*.whl"))
    shipped = {Path(n).parent.as_posix() for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    in_tree = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "mlx_diloco").rglob("__init__.py")}
    assert in_tree <= shipped, f"packages missing from the wheel: {sorted(in_tree - shipped)}"
    static = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mlx_diloco" / "dashboard" / "static").rglob("*") if p.is_file()}
    assert static and static <= set(zipfile.ZipFile(wheel).namelist())  # the dashboard's page and its uPlot

    # A fresh virtualenv with the wheel, reading the other dependencies from this one (offline).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)

    def cli(*args):
        out = subprocess.run([venv / "bin" / "mlx-diloco", *args], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout + out.stderr

    where = subprocess.run([venv / "bin" / "python", "-c", "import mlx_diloco; print(mlx_diloco.__file__)"],
                           cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(venv)), where  # the installed wheel, not this checkout
    assert "shakespeare-home" in cli("gym", "list")
    out = cli("sim", "--model", "tiny", "--steps", "4", "--sync-every", "2", "--seq-len", "16", "--batch-size", "2",
              "--eval-sequences", "2", "--run-dir", str(tmp_path / "run"))
    assert (tmp_path / "run" / "summary.json").exists(), out
