"""Where a report came from: device, driver, toolchain versions, git commit, date and command."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Union

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_document(path, schema: str) -> dict:
    """The JSON document at ``path`` (a report, a baseline); ValueError saying what was expected
    and what was found where it cannot be read or does not carry ``schema``."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"expected a readable JSON document, got {path} ({exc})") from None
    found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
    if found != schema:
        raise ValueError(f"expected schema {schema!r}, got {found!r} in {path}")
    return doc


# The process's umask, read once (reading it means setting it).
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path, content: Union[str, bytes, Callable]) -> Path:
    """Write ``content`` (text, bytes, or a function writing to a binary file object) to a
    temporary file beside ``path``, then rename it over ``path``: a reader, or a run killed
    mid-write (a device call's time limit), sees the old file or the new one, never half of one.
    Every report and artifact is written this way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)      # as open() would create it (mkstemp's is 0600)
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path, document) -> Path:
    """``document`` as indented JSON (what JSON lacks as its str), written by ``atomic_write``."""
    return atomic_write(path, json.dumps(document, indent=1, default=str) + "\n")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tileiras_version() -> str | None:
    """The version of the tileiras binary cuTile will run (the wheel's metadata when it is not
    installed as a distribution, as on the GPU machine where it travels in a tarball)."""
    try:
        from cuda.tile._compile import _find_compiler_bin  # noqa: PLC0415
        tileiras = _find_compiler_bin().path
    except Exception:  # cuTile absent or its layout changed: fall back to the distribution
        tileiras = None
    if tileiras:
        try:
            text = subprocess.run([str(tileiras), "--version"], capture_output=True, text=True,
                                  timeout=30).stdout
            for line in text.splitlines():
                if "release" in line or "V1" in line:
                    return line.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return _version("nvidia-cuda-tileiras")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_state() -> dict:
    """The commit and whether tracked files differ from it. MAMBA2_CUTILE_GIT_COMMIT, when set,
    names the commit the tree was copied from and wins over any .git: the GPU machine's copy may
    carry no .git, or a stale one from an earlier sync (seen: it reported an older commit, dirty);
    dirtiness is then unknown (None), never guessed."""
    named = os.environ.get("MAMBA2_CUTILE_GIT_COMMIT")
    commit = None if named else _git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": named, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def device_label() -> str:
    """'h200'-style folder name of the GPU, or 'cpu' where there is none."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    return name.split()[0] if name else "gpu"


def collect(command: list[str] | None = None) -> dict:
    """A JSON-able record of the environment a result was produced in."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # Quoted where a word holds spaces (ab's --case and --arm): the line replays as it ran.
        "command": shlex.join(command if command is not None else sys.argv),
        **_git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_tile": _version("cuda-tile") or _cutile_module_version(),
        "tileiras": _tileiras_version(),
        # A first call compiles its kernels unless this cache holds them (first_call_s rows).
        "cutile_disk_cache": _cutile_cache_dir(),
        "host": platform.node(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), compute_capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, cuda_runtime=torch.version.cuda,
                    driver=_nvidia_smi("driver_version"))
    if os.environ.get("CI"):
        info["ci"] = True
    return info


def _cutile_cache_dir() -> str | None:
    """Where cuTile keeps compiled kernels across processes ($CUDA_TILE_CACHE_DIR, by default
    ~/.cache/cutile-python), as cuTile reads it; None where the cache is off (or no cuTile)."""
    try:
        from cutile_cache._env import get_cache_dir_from_env  # noqa: PLC0415
    except ImportError:
        return None
    return get_cache_dir_from_env()


def _cutile_module_version() -> str | None:
    try:
        import cuda.tile  # noqa: PLC0415
        return cuda.tile.__version__
    except Exception:
        return None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
