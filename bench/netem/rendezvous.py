"""Horovod's Gloo rendezvous server, as horovodrun starts it: ``rendezvous.py PORT HOSTS``.
Runs until killed (NetEm.run kills it when the ranks are done)."""
import sys
import time

from horovod.runner.common.util import hosts as hosts_util
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

port, hosts = int(sys.argv[1]), sys.argv[2]
plan = hosts_util.get_host_assignments(hosts_util.parse_hosts(hosts), len(hosts.split(",")))
server = RendezvousHTTPServer(("0.0.0.0", port), RendezvousHandler, 0)
server.init(plan)
deadline = time.monotonic() + 3600  # bounded even if nobody kills it
while time.monotonic() < deadline:
    server.handle_request()
