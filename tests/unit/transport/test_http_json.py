"""One bounded JSON request over HTTP (rltrain/transport/http_json.py) against a real server on
127.0.0.1: each kind of failure raised as the caller's own type, an empty answer read as None, the
API key sent as a bearer token. The judge's and the fleet's tests run the same code end to end."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rltrain.transport.http_json import Failures, request_json


class Late(TimeoutError):
    pass


class Down(ConnectionError):
    pass


class Refused(ValueError):
    pass


FAILURES = Failures(timeout=Late, unavailable=Down, refused=Refused)
# path -> (status, raw body, seconds before answering)
ANSWERS = {
    "/ok": (200, b'{"echo": 1}', 0.0),
    "/empty": (200, b"", 0.0),
    "/garbled": (200, b"<html>not json</html>", 0.0),
    "/missing": (404, b"no such route", 0.0),
    "/broken": (503, b"overloaded", 0.0),
    "/slow": (200, b"{}", 2.0),
}


@pytest.fixture(scope="module")
def server():
    seen: list[tuple[str, str, str | None, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.command, self.path, self.headers.get("Authorization"), body))
            status, raw, delay_s = ANSWERS[self.path]
            time.sleep(delay_s)
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout)

        do_GET = do_POST = answer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def test_answers_are_decoded_and_the_key_is_a_bearer_token(server):
    url, seen = server
    assert request_json(url + "/ok", {"a": [1, 2]}, 5.0, FAILURES, api_key="k1") == {"echo": 1}
    assert seen[-1] == ("POST", "/ok", "Bearer k1", b'{"a": [1, 2]}')
    assert request_json(url + "/ok", None, 5.0, FAILURES) == {"echo": 1}
    assert seen[-1] == ("GET", "/ok", None, b"")
    assert request_json(url + "/empty", None, 5.0, FAILURES) is None


@pytest.mark.parametrize(
    "path, kind, message",
    [
        ("/garbled", Refused, r"/garbled answered something other than JSON: b'<html>not json</html>'"),
        ("/missing", Refused, r"/missing refused the request with HTTP 404: no such route"),
        ("/broken", Down, r"/broken failed with HTTP 503: overloaded"),
        ("/slow", Late, r"/slow did not answer within 0.3 s"),
    ],
)
def test_each_failure_is_the_callers_own_type(server, path, kind, message):
    url, _ = server
    with pytest.raises(kind, match=message):
        request_json(url + path, {}, 0.3, FAILURES)


def test_an_error_page_is_cut_to_its_first_characters(server):
    url, _ = server
    with pytest.raises(Refused) as info:
        request_json(url + "/missing", {}, 5.0, FAILURES, detail_chars=7)
    assert str(info.value).endswith("HTTP 404: no such")


def test_nobody_listening_is_unavailable():
    with socket.socket() as sock:  # a port that was free a moment ago, and now has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(Down, match="did not answer"):
        request_json(f"http://127.0.0.1:{port}/x", {}, 2.0, FAILURES)
