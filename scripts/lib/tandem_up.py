"""`tandem up` for the bench scripts: started on a free port, ready once the frontend sees
the workers it was asked for."""

import http.client
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# The admin listener (status page, /status.json, /metrics) of each started frontend, by its
# public port.
_ADMIN = {}


def admin_port(port):
    """The admin listener's port of the `tandem up` started on `port`."""
    return _ADMIN[port]


def start(tandem, flags, roles=("decode",)):
    """`tandem up --port P FLAGS…`; returns (process, port) once /metrics counts one worker
    of each of `roles` (on the admin listener: `admin_port(port)`). Exits with tandem up's log
    if it stops first."""
    port, admin = free_port(), free_port()
    _ADMIN[port] = admin
    log = tempfile.TemporaryFile()
    p = subprocess.Popen([tandem, "up", "--port", str(port),
                          "--admin-listen", f"127.0.0.1:{admin}", *flags],
                         stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            c = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
            c.request("GET", "/metrics")
            m = c.getresponse().read().decode()
            if all(f'tandem_workers{{role="{r}"}} 1' in m for r in roles):
                return p, port
        except OSError:
            pass
        if p.poll() is not None:
            log.seek(0)
            sys.exit(f"tandem up exited:\n{log.read().decode()}")
        time.sleep(0.1)
    sys.exit("tandem up did not see its workers")


def stop(p):
    p.send_signal(2)
    p.wait(timeout=120)
