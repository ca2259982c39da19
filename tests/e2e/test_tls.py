"""--ssl-keyfile/--ssl-certfile: the server speaks HTTPS (a self-signed certificate, on a tiny model)."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.e2e.conftest import running_server

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_with_a_self_signed_certificate(tiny_model_factory, tmp_path):
    directory, _ = tiny_model_factory("llama", False)
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    args = ["--model", directory, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--log-level", "warning"]  # fmt: skip
    trust = ssl.create_default_context(cafile=str(cert))
    # Ready once /health answers over HTTPS, with the certificate trusted.
    with running_server(args, tmp_path / "tls.log", tls=trust) as server:
        url = server.base_url
        body = {"model": server.served_model(),
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}  # fmt: skip
        response = httpx.post(f"{url}/v1/chat/completions", json=body, verify=trust, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] <= 4
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is refused
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=2).raise_for_status()
