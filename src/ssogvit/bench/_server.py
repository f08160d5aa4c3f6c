"""A fork server for benchmark points: ``python -m ssogvit.bench._server``.

It imports torch and ssogvit once and never runs a model. For each point (one JSON line on stdin) it forks a child
that runs the point (``ssogvit.bench._worker.run``) and exits, so every point has a process of its own, as clean as
a new interpreter but without its start-up cost. Replies are single lines after ``REPLY_MARKER`` on stdout:
``{"result": dict | null, "code": exit code, "timed_out": bool}``. A child's own prints go to stderr.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

REPLY_MARKER = "SSOGVIT_BENCH_REPLY "


def _child(spec: dict, write_fd: int) -> None:
    os.dup2(2, 1)  # keep the reply channel clean
    code = 0
    try:
        from ssogvit.bench._worker import run

        data = json.dumps(run(spec)).encode()
        with os.fdopen(write_fd, "wb") as f:
            f.write(data)
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def _serve_one(spec: dict, timeout: float | None) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(spec, write_fd)
    os.close(write_fd)
    chunks, timed_out = [], False
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], wait)
        if not ready:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    result = None
    if chunks and not timed_out:
        try:
            result = json.loads(b"".join(chunks))
        except ValueError:
            result = None
    return {"result": result, "code": os.waitstatus_to_exitcode(status), "timed_out": timed_out}


def main() -> int:
    import ssogvit.bench._preload  # noqa: F401

    sys.stdout.write(REPLY_MARKER + json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply = _serve_one(request["point"], request.get("timeout"))
        sys.stdout.write(REPLY_MARKER + json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
