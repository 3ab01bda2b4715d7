"""The server's listening socket: a backlog for bursts, a bound on the connections served at
once, and a timeout on a client that stops sending or reading.

Python's ``ThreadingHTTPServer`` starts a thread for every connection it accepts, without
limit: a burst (or a client that opens connections and sends nothing) grows threads and
memory until the process fails. Here at most ``max_connections`` are served at once (each
connection is one request: mlx-lm's handler speaks HTTP/1.0); one past that is answered
``503`` in OpenAI's error shape with ``Retry-After`` and closed, by one refusing thread (not
a thread each), as Redis answers a client past ``maxclients``. A connection whose client
sends nothing, or reads nothing, for ``CLIENT_TIMEOUT`` seconds is closed (a socket
operation that waits longer raises in its handler), so idle clients cannot hold every slot.
"""

import json
import queue
import socket
import threading
from http.server import ThreadingHTTPServer

#: pending connections the kernel keeps for a burst (Python's default of 5 drops the rest)
LISTEN_BACKLOG = 128
#: seconds a socket operation of a client connection may wait (reading the request, or
#: writing an answer the client does not read)
CLIENT_TIMEOUT = 60.0
#: refused connections waiting for their 503; past that they are closed without one
REFUSALS_QUEUED = 64

_BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the server is serving its maximum of connections (--max-connections): try again",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
).encode()
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\nConnection: close\r\n\r\n".encode()
    + _BUSY_BODY
)


def listening_server(address, family, handler, max_connections: int, refused=None) -> ThreadingHTTPServer:
    """A bound, listening ``ThreadingHTTPServer`` on ``address`` serving at most
    ``max_connections`` connections at once; ``refused()`` is called for each one refused."""
    attributes = {"address_family": family, "request_queue_size": LISTEN_BACKLOG}
    server_class = type("MLXKVHTTPServer", (BoundedHTTPServer,), attributes)
    return server_class(address, handler, max_connections=max_connections, refused=refused)


class BoundedHTTPServer(ThreadingHTTPServer):
    def __init__(self, address, handler, *, max_connections: int, refused=None):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._served = 0  # connections being served now
        self._refused = refused or (lambda: None)
        self._refusals: queue.Queue = queue.Queue(REFUSALS_QUEUED)
        threading.Thread(target=self._refuse_loop, name="mlxkv-serve-refuser", daemon=True).start()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return self._served

    def _take_slot(self) -> bool:
        with self._lock:
            if self._served >= self.max_connections:
                return False
            self._served += 1
            return True

    def _free_slot(self) -> None:
        with self._lock:
            self._served -= 1

    def process_request(self, request, client_address):
        request.settimeout(CLIENT_TIMEOUT)
        if not self._take_slot():
            self._refused()
            try:
                self._refusals.put_nowait(request)
            except queue.Full:
                self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # the connection's thread
        except BaseException:
            self._free_slot()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._free_slot()

    def _refuse_loop(self):
        while True:
            request = self._refusals.get()
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
                request.shutdown(socket.SHUT_WR)
                while request.recv(65536):  # the request, read so closing does not reset the answer
                    pass
            except OSError:
                pass
            finally:
                request.close()
