"""Can this machine run the kernels? Clear errors for CPU tensors, no CUDA, or no tileiras."""
from __future__ import annotations

import functools
import os

import torch

from kernels.contract import SSDInputError


class CuTileUnavailable(RuntimeError):
    """The kernels cannot run here; the message says what is missing and what to do."""


# cuTile compiles for compute capability 8.0 and later (Ampere on); tileiras has no older target.
MIN_CAPABILITY = 80


@functools.cache
def tileiras_path() -> str:
    """The tileiras compiler cuTile will run, or CuTileUnavailable."""
    try:
        from cuda.tile._compile import _find_compiler_bin  # noqa: PLC0415
        return str(_find_compiler_bin().path)
    except ImportError as exc:
        raise CuTileUnavailable(
            f"cuTile does not import ({exc}); install it with `pip install cuda-tile[tileiras]`"
        ) from exc
    except FileNotFoundError as exc:
        raise CuTileUnavailable(
            "the tileiras compiler was not found, and cuTile compiles every kernel with it: "
            "install it with `pip install nvidia-cuda-tileiras==13.4.*` (or a CUDA Toolkit 13.4+ "
            f"with tileiras on PATH). cuTile said: {exc}") from exc


def tileiras_env() -> dict[str, str]:
    """The environment cuTile's JIT runs tileiras in, for running it ourselves: cuTile's PATH and
    LD_LIBRARY_PATH, and for a pip-installed tileiras no CUDA_HOME or CUDA_PATH. With them set,
    that tileiras reads the toolkit they name and fails ("failed to compile Tile IR program", exit
    5) when it is another release: on the H200 host CUDA_HOME is /usr/local/cuda (13.0)."""
    tileiras_path()
    from cuda.tile._compile import _find_compiler_bin  # noqa: PLC0415
    compiler = _find_compiler_bin()
    env = dict(os.environ, PATH=compiler.bin_path, LD_LIBRARY_PATH=compiler.ld_path)
    if not compiler.pass_cuda_home_var:
        env.pop("CUDA_HOME", None)
        env.pop("CUDA_PATH", None)
    return env


@functools.cache
def _cuda_properties(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, 10 * props.major + props.minor


def _properties(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return _cuda_properties(device.index if device.index is not None
                            else torch.cuda.current_device())


def sm_count(device: torch.device) -> int | None:
    """The SMs of a CUDA device; None for any other (the host code also runs on meta and CPU
    tensors, in CI)."""
    props = _properties(device)
    return props and props[0]


def compute_capability(device: torch.device) -> int | None:
    """A CUDA device's compute capability as 10 * major + minor (90 on an H200); None for any
    other device."""
    props = _properties(device)
    return props and props[1]


def launch_stream(t: torch.Tensor, stream=None):
    """``stream``, else the current stream of t's device, not the current device's: cuTile
    launches in the stream's context, so with the inputs on another GPU a kernel would read them
    from there, unordered with the work that wrote them."""
    return torch.cuda.current_stream(t.device) if stream is None else stream


def require_gpu(x: torch.Tensor) -> None:
    """x (and so every input: the contract checks they share its device) must be on a GPU that
    torch can drive, and cuTile must be able to compile."""
    if not torch.cuda.is_available():
        raise CuTileUnavailable(
            "no CUDA device is visible to torch: the cuTile SSD kernels run on NVIDIA GPUs "
            "(compute capability 8.0+). On a CPU-only machine use "
            "oracles.chunked_reference.ssd_reference, the same algorithm in torch.")
    if x.device.type != "cuda":
        raise SSDInputError(f"x: expected a CUDA tensor (the cuTile kernels run on the GPU), got a "
                            f"tensor on {x.device}; move every input with .cuda()")
    capability = compute_capability(x.device)
    if capability < MIN_CAPABILITY:
        raise CuTileUnavailable(
            f"x: expected a GPU of compute capability {MIN_CAPABILITY // 10}.{MIN_CAPABILITY % 10}"
            f" or later (cuTile compiles for Ampere on), got {capability // 10}.{capability % 10}"
            f" ({torch.cuda.get_device_name(x.device)}, {x.device}). On this GPU use "
            f"oracles.chunked_reference.ssd_reference, the same algorithm in torch.")
    tileiras_path()
