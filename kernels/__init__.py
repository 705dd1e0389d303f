"""Mamba-2 SSD forward kernels in cuTile: ``ssd_forward`` (a drop-in for mamba_ssm's
``mamba_chunk_scan_combined``) and ``ssd_forward_stages`` (every intermediate stage).

The kernels import cuTile lazily: ``kernels.contract`` (the argument contract every oracle uses)
must import on machines without it, and without a cycle through ``oracles.common``.
"""

_EXPORTS = {"ssd_forward", "ssd_forward_stages", "SUPPORTED_CHUNK_SIZES", "DEFAULT_CHUNK_SIZE",
            "UNSUPPORTED_FEATURES"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        from kernels import ssd  # noqa: PLC0415
        return getattr(ssd, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
