"""MediaFetcher against a real HTTP server on loopback (reachable only through the test-only
allow_loopback_for_tests) and real files: what it fetches, and every refusal of MindIE's rules, each a
MediaError (a 400 naming the part) or, for a server-side shortage, a ServerBusyError (429)."""

from __future__ import annotations

import asyncio
import os

import pytest

from serval.serving.errors import ServerBusyError
from serval.serving.media.fetch import MediaFetcher, address_problem
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaSource
from tests.serving.media.files import image_bytes
from tests.serving.media.http_server import MediaServer

PNG = image_bytes(8, 8)
PARAM = "messages[0].content[1]"


@pytest.fixture(scope="module")
def server():
    with MediaServer({"/image.png": PNG}) as server:
        yield server


def config(**fields) -> MediaConfig:
    fields.setdefault("allowed_domains", ("127.0.0.1", "media.test"))
    fields.setdefault("allow_loopback_for_tests", True)
    return MediaConfig(**fields)


def fetch(fetcher: MediaFetcher, url: str, max_bytes: int = 1 << 20) -> bytes:
    async def run() -> bytes:
        with await fetcher.fetch(MediaSource("http", url, max_bytes), PARAM) as file:
            return file.read()

    return asyncio.run(run())


def refusal(fetcher: MediaFetcher, url: str, max_bytes: int = 1 << 20) -> MediaError:
    with pytest.raises(MediaError) as error:
        fetch(fetcher, url, max_bytes)
    assert error.value.param == PARAM and PARAM in str(error.value)
    return error.value


class Resolver:
    """Maps every name to fixed addresses, answering with the next list on each call; counts calls."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.num_calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.num_calls += 1
        return self.answers[min(self.num_calls, len(self.answers)) - 1]


def test_fetches_an_allowed_url(server):
    assert fetch(MediaFetcher(config()), server.url("/image.png")) == PNG


def test_loopback_is_refused_without_the_test_switch(server):
    fetcher = MediaFetcher(config(allow_loopback_for_tests=False))
    before = server.num_requests
    error = refusal(fetcher, server.url("/image.png"))
    assert "loopback" in str(error) and error.code == "media_refused"
    assert server.num_requests == before  # refused before connecting


def test_a_host_off_the_allowlist_is_refused(server):
    fetcher = MediaFetcher(config(allowed_domains=("media.test",)), Resolver(["127.0.0.1"]))
    assert "not on this server's media allowlist" in str(refusal(fetcher, server.url("/image.png")))
    assert "allowlist" in str(refusal(MediaFetcher(config(allowed_domains=())), server.url("/image.png")))


@pytest.mark.parametrize(
    "address, problem",
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.7", "private"),
        ("169.254.169.254", "link-local"),
        ("100.64.0.1", "not a public address"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fd00::1", "private"),
        ("::ffff:127.0.0.1", "IPv4-mapped"),
        ("::ffff:8.8.8.8", "IPv4-mapped"),
        ("2002:7f00:1::", "around a loopback address"),  # 6to4 of 127.0.0.1
        ("64:ff9b::a00:1", "around a private address"),  # NAT64 of 10.0.0.1
    ],
)
def test_an_allowlisted_name_resolving_inward_is_refused(server, address, problem):
    resolver = Resolver([address])
    fetcher = MediaFetcher(config(allow_loopback_for_tests=False), resolver)
    error = refusal(fetcher, server.url("/image.png", host="media.test"))
    assert problem in str(error) and error.code == "media_refused"
    assert resolver.num_calls == 1


def test_one_bad_address_among_good_ones_refuses_the_host():
    assert address_problem("8.8.8.8") is None and address_problem("2001:4860:4860::8888") is None
    resolver = Resolver(["8.8.8.8", "10.0.0.1"])
    error = refusal(MediaFetcher(config(), resolver), "http://media.test/image.png")
    assert "private" in str(error)


def test_connects_to_the_checked_address_with_the_name_as_host(server):
    # A second answer would point elsewhere (DNS rebinding): the name is resolved once and that is used.
    resolver = Resolver(["127.0.0.1"], ["10.0.0.1"])
    assert fetch(MediaFetcher(config(), resolver), server.url("/image.png", host="media.test")) == PNG
    assert resolver.num_calls == 1
    assert server.hosts[-1] == f"media.test:{server.port}"


def test_redirects_are_checked_at_every_hop(server):
    fetcher = MediaFetcher(config(), Resolver(["127.0.0.1"]))
    target = server.url("/image.png")
    assert fetch(fetcher, server.url(f"/redirect?to={target}")) == PNG
    assert fetch(fetcher, server.url("/redirect?status=307&to=/image.png")) == PNG  # relative Location
    evil = server.url("/image.png", host="evil.test")
    assert "'evil.test' is not on" in str(refusal(fetcher, server.url(f"/redirect?to={evil}")))
    assert "http(s)" in str(refusal(fetcher, server.url("/redirect?to=file:///etc/passwd")))
    chain = target
    for _ in range(4):
        chain = server.url(f"/redirect?to={chain}")
    assert "redirected more than 3 times" in str(refusal(fetcher, chain))


def test_a_declared_length_over_the_cap_is_refused_before_the_body(server):
    error = refusal(MediaFetcher(config()), server.url("/declared?length=5000000"), max_bytes=1_000_000)
    assert "5000000 bytes" in str(error)


def test_the_cap_is_enforced_while_streaming(server):
    cap = 1 << 20
    error = refusal(MediaFetcher(config()), server.url("/endless"), max_bytes=cap)
    assert f"more than {cap} bytes" in str(error)
    assert server.endless_done.wait(10), "the server was still sending 10 s after the client gave up"
    # 256 MiB on offer; what went out is the cap plus what the two kernels' socket buffers held.
    assert server.num_bytes_sent < cap + 8 * (1 << 20)  # sent 1.3 MiB here


def test_compressed_bodies_are_refused(server):
    assert "gzip-encoded" in str(refusal(MediaFetcher(config()), server.url("/gzip")))


def test_http_errors_are_refused(server):
    assert "HTTP 404" in str(refusal(MediaFetcher(config()), server.url("/missing.png")))


def test_a_slow_server_times_out(server):
    fetcher = MediaFetcher(config(read_timeout=0.3))
    assert "timed out" in str(refusal(fetcher, server.url("/slow?seconds=2")))


def test_a_dripping_server_hits_the_download_deadline(server):
    fetcher = MediaFetcher(config(read_timeout=0.5, fetch_timeout=1.0))
    assert "took longer than 1 s" in str(refusal(fetcher, server.url("/drip")))


def test_concurrent_downloads_are_bounded(server):
    fetcher = MediaFetcher(config(max_concurrent_fetches=2))
    server.most_holding = 0

    async def run() -> list[bytes]:
        async def one(k: int) -> bytes:
            with await fetcher.fetch(
                MediaSource("http", server.url(f"/hold?seconds=0.3&k={k}"), 1 << 20), PARAM
            ) as f:
                return f.read()

        return await asyncio.gather(*(one(k) for k in range(6)))

    assert asyncio.run(run()) == [PNG] * 6
    assert server.most_holding == 2  # never more at once, and the slots were used


def test_downloads_reserve_spool_space(server, tmp_path):
    # A download that will spill to disk needs its size free there (MindIE's reservation); else a 429.
    fetcher = MediaFetcher(config(spool_memory_bytes=16, spool_dir=str(tmp_path)), free_space=lambda path: 10)
    with pytest.raises(ServerBusyError):
        fetch(fetcher, server.url("/image.png"))
    assert not fetcher.has_reserved_space()
    roomy = MediaFetcher(
        config(spool_memory_bytes=16, spool_dir=str(tmp_path)), free_space=lambda path: 1 << 50
    )
    assert fetch(roomy, server.url("/image.png")) == PNG and roomy.num_reserved_bytes == 0
    assert roomy.has_reserved_space()


# ---- local files


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(PNG)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.png").write_bytes(b"secret")
    os.symlink(secret / "key.png", root / "escape.png")
    os.symlink(root / "cat.png", root / "sub" / "inner.png")
    return root


def read_local(root, location: str, max_bytes: int = 1 << 20) -> bytes:
    fetcher = MediaFetcher(config(local_media_root=str(root)))
    with fetcher.open_local(MediaSource("path", location, max_bytes), PARAM) as file:
        return file.read()


def local_refusal(root, location: str, max_bytes: int = 1 << 20) -> str:
    with pytest.raises(MediaError) as error:
        read_local(root, location, max_bytes)
    assert error.value.param == PARAM
    return str(error.value)


def test_local_files_under_the_root(media_root):
    assert read_local(media_root, "cat.png") == PNG
    assert read_local(media_root, str(media_root / "cat.png")) == PNG  # absolute, inside
    assert read_local(media_root, "sub/../cat.png") == PNG
    assert read_local(media_root, "sub/inner.png") == PNG  # a symlink that stays inside


def test_local_files_outside_the_root_are_refused(media_root):
    for location in ("escape.png", "../secret/key.png", str(media_root.parent / "secret" / "key.png"),
                     "sub/../../secret/key.png", "/etc/passwd"):  # fmt: skip
        assert "outside the allowed local media directory" in local_refusal(media_root, location), location


def test_local_file_problems(media_root, tmp_path):
    assert "does not exist" in local_refusal(media_root, "nope.png")
    assert "not a regular file" in local_refusal(media_root, "sub")
    assert "the limit for this part is 10 bytes" in local_refusal(media_root, "cat.png", max_bytes=10)
    assert "does not exist on this server" in local_refusal(tmp_path / "missing-root", "cat.png")
    with pytest.raises(MediaError, match="not enabled"):
        MediaFetcher(config(local_media_root=None)).open_local(MediaSource("path", "cat.png", 10), PARAM)
