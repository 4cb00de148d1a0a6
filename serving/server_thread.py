"""Running an app: ``bind`` opens the listening socket (before the banner is printed, so the banner
names the real port, and ``--port 0`` works); ``ServerThread`` runs an app on loopback in a
thread for tests and notebooks."""

import socket
import threading
import time


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {err.strerror}") from None
    # Listening now, not when uvicorn starts: a client that connects as soon as it reads the
    # banner waits in the backlog instead of being refused (seen in CI under load).
    sock.listen(2048)
    return sock


class ServerThread:
    """Run an app on loopback in a background thread (tests, notebooks)::

        engine = AsyncLLMEngine(llm.engine, ServerMetrics("tiny-pydoc"))
        with ServerThread(build_app(engine, "tiny-pydoc")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
