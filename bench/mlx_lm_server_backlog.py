"""mlx_lm.server with a wider listen backlog, for side-by-side runs at high concurrency.

mlx_lm.server serves through the standard library's ThreadingHTTPServer, whose listen
backlog is socketserver's default of 5. When 64 or 128 clients connect at once, the
kernel drops the connection attempts that overflow it and the clients resend them after
1, 3, 7, 15 ... seconds (TCP's backoff): on the H200 (2026-11-30) that left TTFT p99 at
38 s with 64 streams and cut the measured output tok/s to a quarter of what the server
decodes. This raises the backlog before the server starts, changing nothing else.

    python bench/mlx_lm_server_backlog.py BACKLOG [mlx_lm.server flags ...]
"""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer


def main() -> None:
    ThreadingHTTPServer.request_queue_size = int(sys.argv[1])
    sys.argv = ["mlx_lm.server", *sys.argv[2:]]
    from mlx_lm.server import main as serve

    serve()


if __name__ == "__main__":
    main()
