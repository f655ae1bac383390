"""A webhook receiver on 127.0.0.1 for the notification tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Hook:
    """A webhook receiver. ``script``: status codes to answer in turn (then 200);
    ``delay_s``: how long each answer takes."""

    def __init__(self, script=(), delay_s=0.0):
        self.script = list(script)
        self.delay_s = delay_s
        self.got = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.got.append((self.path, self.headers.get("Content-Type"), json.loads(body)))
                time.sleep(hook.delay_s)
                code = hook.script.pop(0) if hook.script else 200
                self.send_response(code)
                self.end_headers()
                try:
                    self.wfile.write(b"ok")
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/SECRET-TOKEN"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
