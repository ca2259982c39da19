"""Real media files made on the fly: Pillow writes images, PyAV writes video and audio (a sine tone), and a
hand-built PNG declares 50000 x 50000 pixels in a few hundred bytes (a decompression bomb)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np


def image_bytes(
    width: int, height: int, fmt: str = "PNG", color: tuple[int, int, int] = (200, 30, 90)
) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (width, height), color)
    # A gradient, so resizing and hashing see real content rather than one flat colour.
    pixels = np.asarray(image).copy()
    pixels[:, :, 1] = (np.arange(width)[None, :] * 255 // max(1, width - 1)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def png_bomb(width: int = 50_000, height: int = 50_000) -> bytes:
    """A valid PNG header declaring width x height RGB pixels, with a tiny IDAT: decoding it would allocate
    width * height * 3 bytes (7.5 GB here)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width * 3 + 1) * 4, 9)  # four zero rows: a few hundred bytes
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def video_bytes(
    seconds: float = 2.0, fps: int = 10, width: int = 64, height: int = 48, fmt: str = "mp4"
) -> bytes:
    """A video of `seconds` at `fps`, each frame a different grey level (frame k is k * 8 % 256)."""
    import av

    codec = {"mp4": "mpeg4", "avi": "mpeg4", "asf": "wmv2"}[fmt]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(round(seconds * fps)):
            pixels = np.full((height, width, 3), k * 8 % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def audio_bytes(seconds: float = 1.0, rate: int = 44_100, fmt: str = "wav", hz: float = 440.0) -> bytes:
    """A stereo sine tone of `seconds` at `rate` Hz in wav, mp3 or flac."""
    import av

    codec, sample_format = {
        "wav": ("pcm_s16le", "s16"),
        "mp3": ("libmp3lame", "s16p"),
        "flac": ("flac", "s16"),
    }[fmt]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="stereo")
        stream.format = sample_format
        tone = (np.sin(2 * np.pi * hz * np.arange(round(seconds * rate)) / rate) * 0.5 * 32767).astype(
            np.int16
        )
        step = 1152  # MP3's frame size; any size does for the others
        for start in range(0, len(tone), step):
            piece = tone[start : start + step]
            if sample_format == "s16p":
                frame = av.AudioFrame.from_ndarray(np.stack([piece, piece]), format="s16p", layout="stereo")
            else:
                frame = av.AudioFrame.from_ndarray(
                    np.repeat(piece, 2)[None, :], format="s16", layout="stereo"
                )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()
