"""MediaFetcher: a part's bytes from inline data, a local file under the media root, or an allowlisted URL.

Owns MindIE's fetch rules, on by default, and what they leave implicit:
- Local files only under `local_media_root`, judged after resolution (realpath: symlinks and `..`), then
  opened without following a last-moment symlink and checked again by the descriptor's own path.
- http(s) only to hosts on the allowlist, exactly. The host is resolved once and every address it resolves
  to must be public (no loopback, private, link-local, shared, multicast, reserved or unspecified address, no
  IPv4-mapped, 6to4 or Teredo address around one); the connection goes to the checked address (the URL is
  rewritten to it, Host and TLS SNI carry the name, the certificate is verified for the name), so a second
  DNS answer cannot redirect it. No proxy from the environment, no connection reuse across names.
- Redirects are followed by hand, each hop checked as above, at most `max_redirects`.
- Connect and read timeouts, and a deadline for the whole download (a server dripping a byte a second).
- The byte cap is enforced while streaming: a declared Content-Length over it is refused before the body,
  and the connection is dropped the moment the count passes it. Compressed transfer encodings are refused
  (identity is asked for), so a small gzip body cannot expand past the cap.
- At most `max_concurrent_fetches` downloads at once; a download waits for a slot within its deadline.
- MindIE's reservation: downloads past `spool_memory_bytes` spill to a temporary file, and each reserves
  its expected size against the spool directory's free space before reading; without the room, 429.
Every refusal is a MediaError (400) naming the part, or ServerBusyError (429) for a server-side shortage.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urljoin, urlsplit

from serval.serving.errors import ServerBusyError
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaSource

if TYPE_CHECKING:
    import httpx  # imported where a fetch starts: a server that never fetches skips its ~50 ms import

# host, port -> the addresses it resolves to (tests map names to the addresses they need).
Resolver = Callable[[str, int], Awaitable[list[str]]]
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 64 * 1024


async def system_resolve(host: str, port: int) -> list[str]:
    """getaddrinfo in the loop's resolver thread: the event loop never blocks on DNS."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def address_problem(text: str, allow_loopback: bool = False) -> str | None:
    """Why a resolved address must not be connected to, or None for a public one."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone id says nothing about the address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return "an IPv4-mapped IPv6 address"
        embedded = [ip.sixtofour, *(ip.teredo or ())]
        if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64: the IPv4 address is the low 32 bits
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        for inner in embedded:
            if inner is not None and address_problem(str(inner)) is not None:
                return f"an IPv6 address around {address_problem(str(inner))} ({inner})"
    if ip.is_loopback:
        return None if allow_loopback else "a loopback address"
    checks = (("is_unspecified", "an unspecified address"), ("is_link_local", "a link-local address"),
              ("is_multicast", "a multicast address"), ("is_reserved", "a reserved address"),
              ("is_private", "a private address"))  # fmt: skip
    for attribute, problem in checks:
        if getattr(ip, attribute):
            return problem
    return None if ip.is_global else "not a public address"


class MediaFetcher:
    """One server's fetching: its download slots and spool reservation live here (no module state)."""

    def __init__(
        self,
        config: MediaConfig,
        resolve: Resolver | None = None,
        free_space: Callable[[str], int] | None = None,
    ) -> None:
        """resolve: host lookups (the system's by default). free_space: bytes free under a directory."""
        self.config = config
        self.resolve = resolve or system_resolve
        self.free_space = free_space or (lambda path: shutil.disk_usage(path).free)
        self.spool_dir = config.spool_dir or tempfile.gettempdir()
        self._slots = asyncio.Semaphore(config.max_concurrent_fetches)
        self.num_reserved_bytes = 0  # spool bytes reserved by downloads in flight

    def has_reserved_space(self) -> bool:
        """MindIE's start-up rule: the spool directory has room for the largest file from every download
        slot at once, x 1.5 (MediaConfig.reservation_bytes)."""
        return self.free_space(self.spool_dir) >= self.config.reservation_bytes

    async def fetch(self, source: MediaSource, param: str) -> BinaryIO:
        """The source's bytes as a file positioned at 0 (the caller closes it)."""
        if source.scheme == "data":
            assert source.data is not None
            return _memory_file(source.data)
        if source.scheme == "path":
            return await asyncio.to_thread(self.open_local, source, param)
        return await self.download(source, param)

    # ---- local files

    def open_local(self, source: MediaSource, param: str) -> BinaryIO:
        """The file a path names, if it lies under the media root once resolved (blocking: run in a thread)."""
        configured = self.config.local_media_root
        if configured is None:
            raise MediaError(f"{param}: local media files are not enabled on this server", param)
        root = os.path.realpath(configured)
        if not os.path.isdir(root):
            raise MediaError(f"{param}: the local media directory does not exist on this server", param)
        if "\x00" in source.location:
            raise MediaError(f"{param}: the path holds a NUL character", param)
        real = os.path.realpath(os.path.join(root, source.location))  # an absolute path replaces the root
        outside = f"{param}: {source.describe()} is outside the allowed local media directory"
        if os.path.commonpath([root, real]) != root:
            raise MediaError(outside, param)
        try:
            fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise MediaError(f"{param}: {source.describe()} does not exist", param) from None
        except OSError as e:  # a directory, a symlink swapped in after the check, no permission
            raise MediaError(f"{param}: {source.describe()} cannot be read ({e.strerror})", param) from None
        try:
            info = os.fstat(fd)
            opened = f"/proc/self/fd/{fd}"
            if os.path.exists(opened) and os.path.commonpath([root, os.path.realpath(opened)]) != root:
                raise MediaError(outside, param)  # the path changed between the check and the open
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(f"{param}: {source.describe()} is not a regular file", param)
            if info.st_size > source.max_bytes:
                raise MediaError(_too_large(param, source, info.st_size), param)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    # ---- remote files

    async def download(self, source: MediaSource, param: str) -> BinaryIO:
        is_started = False

        async def in_a_slot() -> BinaryIO:
            nonlocal is_started
            # NOTE: `async with`, not acquire() under a timeout: a cancel never leaks a slot either way.
            async with self._slots:
                is_started = True
                return await self._follow(source, param)

        try:
            return await asyncio.wait_for(in_a_slot(), self.config.fetch_timeout)
        except asyncio.TimeoutError:
            if not is_started:
                raise ServerBusyError("every media download slot stayed busy; retry later") from None
            timeout = self.config.fetch_timeout
            raise MediaError(
                f"{param}: fetching {source.describe()} took longer than {timeout:g} s", param
            ) from None

    async def _follow(self, source: MediaSource, param: str) -> BinaryIO:
        url = source.location
        for _ in range(self.config.max_redirects + 1):
            async with self._request(url, param) as response:
                if response.status_code in REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaError(f"{param}: {source.describe()} redirected without a Location", param)
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise MediaError(
                        f"{param}: {source.describe()} answered HTTP {response.status_code}", param
                    )
                return await self._read_body(response, source, param)
        raise MediaError(
            f"{param}: {source.describe()} redirected more than {self.config.max_redirects} times", param
        )

    async def check_url(self, url: str, param: str) -> tuple[str, str, str]:
        """(the URL rewritten to the checked address, the Host header, the name for TLS) or MediaError."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not host:
            raise MediaError(
                f"{param}: media URLs must be http(s) URLs with a host (got {_shown(url)})", param
            )
        if parts.username is not None or parts.password is not None:
            raise MediaError(f"{param}: media URLs must not carry credentials", param)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MediaError(f"{param}: {_shown(url)} has an invalid port", param) from None
        if host not in self.config.allowed_domains:
            raise MediaError(
                f"{param}: the host {host!r} is not on this server's media allowlist", param, "media_refused"
            )
        try:
            addresses = await self.resolve(host, port)
        except OSError:
            raise MediaError(f"{param}: the host {host!r} could not be resolved", param) from None
        if not addresses:
            raise MediaError(f"{param}: the host {host!r} could not be resolved", param)
        for address in addresses:
            problem = address_problem(address, self.config.allow_loopback_for_tests)
            if problem is not None:
                raise MediaError(
                    f"{param}: the host {host!r} resolves to {problem}, which media is never fetched from",
                    param,
                    "media_refused",
                )
        ip = addresses[0].split("%", 1)[0]
        netloc = f"[{ip}]" if ":" in ip else ip
        pinned = f"{parts.scheme}://{netloc}:{port}{parts.path or '/'}" + (
            f"?{parts.query}" if parts.query else ""
        )
        is_default_port = port == (443 if parts.scheme == "https" else 80)
        return pinned, host if is_default_port else f"{host}:{port}", host

    @contextlib.asynccontextmanager
    async def _request(self, url: str, param: str) -> AsyncIterator[httpx.Response]:
        import httpx

        pinned, host_header, server_name = await self.check_url(url, param)
        config = self.config
        timeout = httpx.Timeout(config.read_timeout, connect=config.connect_timeout)
        # NOTE: a client per hop: no pooled connection (made for one name) ever serves another, and
        # trust_env=False keeps an environment proxy from undoing the pinning.
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            request = client.build_request(
                "GET", pinned, headers={"Host": host_header, "Accept-Encoding": "identity"},
                extensions={"sni_hostname": server_name},
            )  # fmt: skip
            try:
                response = await client.send(request, stream=True)
            except httpx.TimeoutException as e:
                raise MediaError(
                    f"{param}: fetching {_shown(url)} timed out ({type(e).__name__})", param
                ) from None
            except httpx.HTTPError as e:
                raise MediaError(
                    f"{param}: {_shown(url)} could not be fetched ({type(e).__name__})", param
                ) from None
            try:
                yield response
            finally:
                await response.aclose()

    async def _read_body(self, response: httpx.Response, source: MediaSource, param: str) -> BinaryIO:
        import httpx

        cap = source.max_bytes
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise MediaError(
                f"{param}: {source.describe()} came {encoding}-encoded; send it uncompressed", param
            )
        declared = response.headers.get("content-length")
        expected = cap
        if declared is not None and declared.strip().isdigit():
            if int(declared) > cap:
                raise MediaError(_too_large(param, source, int(declared)), param)
            expected = int(declared)
        with self.reserve(expected if expected > self.config.spool_memory_bytes else 0):
            # NOTE: not tempfile.SpooledTemporaryFile: PyAV reads nothing from one still in memory. The file
            # outlives this function (the caller decodes and closes it).
            file: BinaryIO = io.BytesIO()
            try:
                size = 0
                async for chunk in response.aiter_raw(CHUNK_BYTES):
                    size += len(chunk)
                    if size > cap:  # stop reading now: the connection is dropped when the client closes
                        raise MediaError(_too_large(param, source, size, partial=True), param)
                    if size > self.config.spool_memory_bytes and isinstance(file, io.BytesIO):
                        spilled = tempfile.TemporaryFile(dir=self.spool_dir)  # noqa: SIM115
                        spilled.write(file.getbuffer())
                        file = spilled
                    file.write(chunk)
            except httpx.TimeoutException:
                file.close()
                raise MediaError(f"{param}: reading {source.describe()} timed out", param) from None
            except httpx.HTTPError as e:
                file.close()
                raise MediaError(
                    f"{param}: reading {source.describe()} failed ({type(e).__name__})", param
                ) from None
            except BaseException:
                file.close()
                raise
        file.seek(0)
        return file

    @contextlib.contextmanager
    def reserve(self, num_bytes: int):
        """Hold num_bytes of the spool directory's free space for one download (MindIE's reservation)."""
        if num_bytes and self.free_space(self.spool_dir) - self.num_reserved_bytes < num_bytes:
            raise ServerBusyError("not enough free disk space for media downloads; retry later")
        self.num_reserved_bytes += num_bytes
        try:
            yield
        finally:
            self.num_reserved_bytes -= num_bytes


def _memory_file(data: bytes) -> BinaryIO:
    return io.BytesIO(data)


def _shown(url: str) -> str:
    return repr(url if len(url) <= 96 else url[:96] + "...")


def _too_large(param: str, source: MediaSource, size: int, partial: bool = False) -> str:
    what = f"more than {source.max_bytes} bytes" if partial else f"{size} bytes"
    return f"{param}: {source.describe()} is {what}; the limit for this part is {source.max_bytes} bytes"
