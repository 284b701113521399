"""The user's setting (:class:`CupyConfig`, read once from the environment) and a forced
schedule (:class:`Schedule`, for tests and A/B timing)."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

MMA_ENV = "TTT_CUPY_MMA"
CACHE_DIR_ENV = "TTT_CUPY_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/ttt/cupy")

OVERLAP_WAIT_SPINS = 256
"""Naps (about 0.25 us each) a group block of an overlapped pass waits for every chain block
to start before it hands its ticket to the cleanup launch (after the stream wait: never)."""


@dataclass(frozen=True)
class CupyConfig:
    """``mma``: half inputs run their tile products on tensor cores (tf32 ``mma.sync``);
    False (``TTT_CUPY_MMA=0``) runs them as SIMT fp32. ``cache_dir``: where compiled programs
    are kept between processes (``TTT_CUPY_CACHE_DIR``, default ``~/.cache/ttt/cupy``)."""

    mma: bool = True
    cache_dir: Path = field(default_factory=lambda: DEFAULT_CACHE_DIR.expanduser())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CupyConfig:
        value = environ.get(MMA_ENV, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{MMA_ENV}: expected 0, 1 or unset, got {value!r}")
        return cls(mma=value != "0", cache_dir=cache_dir_from(environ.get(CACHE_DIR_ENV)))


def cache_dir_from(value: str | None) -> Path:
    """The absolute cache directory of a ``TTT_CUPY_CACHE_DIR`` value (None, empty: the
    default); ValueError for what cannot be a directory."""
    if value is None or not value.strip():
        return DEFAULT_CACHE_DIR.expanduser()
    if "\0" in value:
        raise ValueError(f"{CACHE_DIR_ENV}: expected a directory path, got {value!r}")
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{CACHE_DIR_ENV}: expected a directory path, got {value!r} "
                         f"(a file that is not a directory)")
    return path


@functools.cache
def config() -> CupyConfig:
    """The process's :class:`CupyConfig`, read from the environment at first use."""
    return CupyConfig.from_env()


@dataclass(frozen=True)
class Schedule:
    """Forces parts of a pass's schedule (``None``: :mod:`ttt_cupy.placement` decides):
    ``fuse_forward`` / ``fuse_backward``, ``overlap``, ``segments`` (K per pass, 1: one launch
    per kernel; needs ``overlap=False``), ``overlap_spins`` (:data:`OVERLAP_WAIT_SPINS`; 0 drops
    the stream wait, so that group blocks hand their tickets to the cleanup launch)."""

    fuse_forward: bool | None = None
    fuse_backward: bool | None = None
    overlap: bool | None = None
    segments: int | None = None
    overlap_spins: int = OVERLAP_WAIT_SPINS

    def __post_init__(self) -> None:
        for name in ("fuse_forward", "fuse_backward", "overlap"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"Schedule.{name}: expected True, False or None, got {value!r}")
        if self.segments is not None:
            if not _count(self.segments) or self.segments < 1:
                raise ValueError(f"Schedule.segments: expected a positive integer or None, "
                                 f"got {self.segments!r}")
            if self.overlap is not False:
                raise ValueError(f"Schedule.segments: a segmented pass is not overlapped, "
                                 f"expected overlap=False, got overlap={self.overlap!r}")
        if not _count(self.overlap_spins) or self.overlap_spins < 0:
            raise ValueError(f"Schedule.overlap_spins: expected a non-negative integer, "
                             f"got {self.overlap_spins!r}")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


AUTO = Schedule()
"""Every choice to the placement rules."""
