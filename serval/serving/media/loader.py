"""MediaLoader: a request's media parts -> MediaItems (fetched, decoded, resized, hashed, counted).

Owns where the work runs and how a failure ends it. Fetching is async on the event loop (fetch.py); decoding
runs in this loader's own small thread pool, so a 512 MB video never holds the loop and at most
`decode_threads` files decode at once whatever the traffic. A request's parts load concurrently; the first
failure cancels the rest and is raised as is. Any decoder failure that is not already a MediaError (Pillow's
and FFmpeg's errors on hostile input come in many types) becomes one naming the part, so no media problem is
ever a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Sequence
from typing import BinaryIO, TypeVar

from serval.serving.errors import ServingError
from serval.serving.media.decode import (
    Decoded,
    DecodedImage,
    DecodedVideo,
    decode_audio,
    decode_image,
    decode_video,
)
from serval.serving.media.fetch import MediaFetcher
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaKind, MediaPart, MediaSource
from serval.serving.media.processor import MediaItem, MediaProcessor, content_hash
from serval.serving.media.resize import ResizeBounds, frame_bounds, resize_bounds, smart_resize

logger = logging.getLogger(__name__)
T = TypeVar("T")


class MediaLoader:
    def __init__(self, config: MediaConfig, fetcher: MediaFetcher | None = None) -> None:
        self.config = config
        self.fetcher = fetcher or MediaFetcher(config)
        # Threads start on first use: a text-only deployment never starts one.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.decode_threads, thread_name_prefix="serval-media"
        )

    def warn_if_short_of_spool_space(self) -> None:
        """MindIE's start-up check, for a server whose model reads media: a warning when the spool directory
        has less room than largest file x concurrent downloads x 1.5 (each download still reserves its own)."""
        if not self.fetcher.has_reserved_space():
            logger.warning(
                "media downloads spool to %s, which has less free space than MindIE reserves for them "
                "(largest file x concurrent downloads x 1.5 = %d bytes)",
                self.fetcher.spool_dir, self.config.reservation_bytes,
            )  # fmt: skip

    def check_count(self, parts: Sequence[MediaPart]) -> None:
        num_items = sum(len(part.sources) for part in parts)
        if num_items > self.config.max_media_items:
            raise MediaError(
                f"the messages hold {num_items} media files; at most {self.config.max_media_items} are accepted",
                "messages",
            )

    async def load(self, parts: Sequence[MediaPart], processor: MediaProcessor) -> list[MediaItem]:
        """Every part loaded, in order; MediaError (400) or ServerBusyError (429) for the first that fails."""
        self.check_count(parts)
        tasks = [asyncio.ensure_future(self.load_part(part, processor)) for part in parts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def load_part(self, part: MediaPart, processor: MediaProcessor) -> MediaItem:
        bounds = resize_bounds(processor.resize_bounds, part.options)
        if part.is_frame_list:
            decoded: Decoded = await self._frame_list(part, bounds)
        else:
            decoded = await self.decode(part, part.sources[0], bounds)
        digest = content_hash(part.kind, decoded)
        loop = asyncio.get_running_loop()
        try:
            num_tokens = processor.num_tokens(decoded)
            # The encoder's input (normalized patches, log-mel features: a few array passes) in the
            # decoding threads too.
            prepared = await loop.run_in_executor(self._executor, processor.encoder_input, decoded, digest)
        except ServingError:
            raise
        except ValueError as e:  # the model cannot take this item (e.g. a clip too short for one row)
            raise MediaError(f"{part.param}: {e}", part.param) from None
        return MediaItem(part.kind, decoded, digest, num_tokens, part.param, prepared)

    async def decode(self, part: MediaPart, source: MediaSource, bounds: ResizeBounds | None) -> Decoded:
        """One file of a part fetched and decoded (bounds: None keeps its size)."""
        config, param, declared = self.config, part.param, source.declared_format
        if part.kind is MediaKind.IMAGE:
            call = functools.partial(
                decode_image, declared=declared, bounds=bounds, config=config, param=param
            )
        elif part.kind is MediaKind.VIDEO:
            call = functools.partial(
                decode_video, declared=declared, fps=part.options.fps, bounds=bounds,
                total_pixels=part.options.total_pixels, config=config, param=param,
            )  # fmt: skip
        else:
            call = functools.partial(decode_audio, declared=declared, config=config, param=param)
        return await self.run(part, source, call)

    async def run(self, part: MediaPart, source: MediaSource, decode: Callable[[BinaryIO], T]) -> T:
        """decode(the source's file) in the decoding threads; the file is closed after."""
        file = await self.fetcher.fetch(source, part.param)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, _guarded, decode, file, part, source)
        finally:
            file.close()

    async def _frame_list(self, part: MediaPart, bounds: ResizeBounds) -> DecodedVideo:
        """Model Studio's `video` as a list of images: the frames, all resized to the first one's size."""
        import numpy as np

        first = await self.decode(part, part.sources[0], None)
        assert isinstance(first, DecodedImage)
        height, width = first.pixels.shape[:2]
        size = smart_resize(height, width, frame_bounds(bounds, len(part.sources), part.options.total_pixels))

        async def frame(source: MediaSource) -> DecodedImage:
            call = functools.partial(
                decode_image, declared=source.declared_format, bounds=None, config=self.config, param=part.param,
                size=size,
            )  # fmt: skip
            return await self.run(part, source, call)

        frames = [first if first.pixels.shape[:2] == size else _resized(first, size)]
        frames += await asyncio.gather(*(frame(source) for source in part.sources[1:]))
        num_frames = len(frames)
        times = tuple(k / part.options.fps for k in range(num_frames))
        return DecodedVideo(
            np.stack([f.pixels for f in frames]), times, num_frames / part.options.fps, "images"
        )

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _guarded(decode: Callable[[BinaryIO], T], file: BinaryIO, part: MediaPart, source: MediaSource) -> T:
    try:
        return decode(file)
    except (MediaError, ServingError):
        raise
    except Exception as e:  # Pillow, FFmpeg and numpy fail on hostile files in many ways
        logger.debug("decoding %s failed", part.param, exc_info=True)
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise MediaError(
            f"{part.param}: {source.describe()} could not be decoded as {part.kind.value}: {reason}",
            part.param,
        ) from None


def _resized(image: DecodedImage, size: tuple[int, int]) -> DecodedImage:
    from PIL import Image

    resized = Image.fromarray(image.pixels).resize((size[1], size[0]), Image.Resampling.BICUBIC)
    import numpy as np

    return DecodedImage(np.asarray(resized), image.format, image.original_size)
