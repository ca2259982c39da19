"""MediaConfig: every limit and switch of media fetching and decoding, frozen, built once at the edge.

Owns the numbers: MindIE's byte caps per kind (images and audio 40 MB, video 512 MB, base64 `input_audio`
20 MB), where local files may come from, which hosts may be fetched, the timeouts, how many fetches run at
once and the spool reservation MindIE asks for, and the decode budgets (pixels, frames, seconds) that keep a
hostile file from costing more than a legitimate one. The CLI builds one from ServerConfig; tests build their
own. `allow_loopback_for_tests` has no flag and no config key: only code can set it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1 << 20
# MindIE's default local media directory.
DEFAULT_MEDIA_ROOT = "/data/multimodal_inputs"
# MindIE: "Maximum size of a single file x Maximum number of concurrent requests x 1.5 (reserved coefficient)".
RESERVE_FACTOR = 1.5


@dataclass(frozen=True)
class MediaConfig:
    # Local files come only from under this directory (symlinks and `..` resolved first). None: no local files.
    local_media_root: str | None = DEFAULT_MEDIA_ROOT
    # Hosts that http(s) URLs may name, exactly (case-insensitive); empty: no remote media at all.
    allowed_domains: tuple[str, ...] = ()
    # Byte caps of one file, per kind (MindIE's "40 MB", "512 MB", "20 MB" read as MiB).
    max_image_bytes: int = 40 * MIB
    max_video_bytes: int = 512 * MIB
    max_audio_bytes: int = 40 * MIB
    max_input_audio_bytes: int = 20 * MIB  # base64 `input_audio.data`, decoded
    # Fetching: seconds to connect, seconds without a byte, seconds for one whole download (a server dripping
    # a byte a second never trips the read timeout), redirects followed (each re-checked), downloads at once.
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    fetch_timeout: float = 60.0
    max_redirects: int = 3
    max_concurrent_fetches: int = 8
    # Downloads land in memory up to this size, then in a temporary file under spool_dir (None: the system's
    # temporary directory), whose free space must cover MindIE's reservation (limits.reservation_bytes).
    spool_memory_bytes: int = 8 * MIB
    spool_dir: str | None = None
    # Decoding budgets, checked from headers before anything is decoded where the format allows.
    max_image_pixels: int = 64 * MIB  # per image or video frame: 8192 x 8192
    max_video_seconds: float = 600.0
    max_video_decoded_frames: int = 18_000  # frames read from the stream, whatever the sampling keeps
    max_video_frames: int = 768  # frames kept after sampling at fps (Qwen2-VL's most)
    max_audio_seconds: float = 600.0
    # Media parts in one request (a Model Studio `video` list counts each image) and decoding threads.
    max_media_items: int = 64
    decode_threads: int = 2
    # Tests only: lets fetches reach 127.0.0.0/8 and ::1 (a test server). No flag or config key sets it.
    allow_loopback_for_tests: bool = False

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_video_bytes", "max_audio_bytes", "max_input_audio_bytes",
                     "max_concurrent_fetches", "max_image_pixels", "max_video_decoded_frames",
                     "max_video_frames", "max_media_items", "decode_threads", "spool_memory_bytes"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("connect_timeout", "read_timeout", "fetch_timeout", "max_video_seconds",
                     "max_audio_seconds"):  # fmt: skip
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        if any(not d or d != d.strip() or "/" in d for d in self.allowed_domains):
            raise ValueError(f"allowed media domains must be bare host names, got {self.allowed_domains}")
        object.__setattr__(self, "allowed_domains", tuple(d.lower() for d in self.allowed_domains))

    @property
    def max_file_bytes(self) -> int:
        return max(self.max_image_bytes, self.max_video_bytes, self.max_audio_bytes)

    @property
    def reservation_bytes(self) -> int:
        """MindIE's disk reservation for downloads: the largest file x downloads at once x 1.5."""
        return math.ceil(self.max_file_bytes * self.max_concurrent_fetches * RESERVE_FACTOR)


def media_config(
    local_media_root: str | None,
    allowed_domains: tuple[str, ...],
    max_concurrent_fetches: int,
    fetch_timeout: float,
) -> MediaConfig:
    """The MediaConfig of the server's settings (ServerConfig): local_media_root None is MindIE's default
    directory and "" is no local files."""
    root = DEFAULT_MEDIA_ROOT if local_media_root is None else (local_media_root or None)
    return MediaConfig(
        local_media_root=root,
        allowed_domains=allowed_domains,
        max_concurrent_fetches=max_concurrent_fetches,
        fetch_timeout=fetch_timeout,
    )
