"""The network a launch uses: hostname, loopback, a free port, MASTER_ADDR/MASTER_PORT if set."""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Mapping

from dtlab.doctor.check import Check, fail, ok, warn


def checks(env: Mapping[str, str]) -> list[Check]:
    result = [hostname(env), loopback(), free_port()]
    if "MASTER_ADDR" in env or "MASTER_PORT" in env:
        result.append(master_endpoint(env))
    return result


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def hostname(env: Mapping[str, str]) -> Check:
    name = socket.gethostname()
    try:
        addrs = _resolve(name)
    except OSError as e:
        return warn("hostname", f"{name} does not resolve ({e.strerror or e})",
                    "gloo finds this node's address through its name; unresolved, it falls back to "
                    "loopback, which works on one node only",
                    f"add '<this node's IP> {name}' to /etc/hosts, or export GLOO_SOCKET_IFNAME")
    found = f"{name} -> {', '.join(addrs)}"
    if not all(is_loopback(a) for a in addrs):
        if not any(_is_local(a) for a in addrs):
            return warn("hostname", f"{found}, not an address of this host",
                        "a stale /etc/hosts or DNS entry; gloo then falls back to loopback, which "
                        "works on one node only", f"fix the entry for {name}, or export "
                        "GLOO_SOCKET_IFNAME=<interface>", addresses=addrs)
        return ok("hostname", found, addresses=addrs)
    master = env.get("MASTER_ADDR", "")
    if master and _is_remote(master) and "GLOO_SOCKET_IFNAME" not in env:
        return warn("hostname", f"{found} (loopback) while MASTER_ADDR={master} is another host",
                    "gloo would advertise this loopback address to the other nodes, which cannot "
                    "connect to it", "export GLOO_SOCKET_IFNAME=<the interface that reaches "
                    "MASTER_ADDR> (NCCL: NCCL_SOCKET_IFNAME)", addresses=addrs)
    return ok("hostname", f"{found} (loopback: fine on one node; several nodes need "
              "GLOO_SOCKET_IFNAME)", addresses=addrs)


def _resolve(host: str) -> list[str]:
    return sorted({a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})


def _is_remote(host: str) -> bool:
    """Resolves, and to no address of this host (an unresolvable name is the master check's)."""
    try:
        return not any(_is_local(a) for a in _resolve(host))
    except OSError:
        return False


def loopback() -> Check:
    """Local collectives and the rendezvous store travel over 127.0.0.1: bind, connect, echo."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                peer, _ = server.accept()
                with peer:
                    client.sendall(b"dtlab")
                    peer.settimeout(5)
                    echoed = peer.recv(5)
            rtt_ms = (time.perf_counter() - start) * 1e3
    except OSError as e:
        return fail("loopback", f"127.0.0.1 bind/connect failed: {e}",
                    "the loopback interface is down or a local firewall blocks it",
                    "ip link set lo up; allow 127.0.0.0/8 in the firewall (iptables -L)")
    if echoed != b"dtlab":
        return fail("loopback", f"127.0.0.1 echoed {echoed!r} instead of b'dtlab'",
                    "something intercepts local TCP traffic", "check firewall/proxy rules for lo")
    return ok("loopback", f"bind, connect and echo on 127.0.0.1:{port} in {rtt_ms:.2f} ms",
              port=port, ms=rtt_ms)


def free_port() -> Check:
    try:
        port = _a_free_port()
    except OSError as e:
        return fail("free_port", f"the OS gave no free port: {e}",
                    "the ephemeral port range is exhausted or networking is disabled",
                    "check /proc/sys/net/ipv4/ip_local_port_range and `ss -s`")
    return ok("free_port", f"the OS gives free ports (e.g. {port}); dtlab's launcher asks it "
              "for one instead of a fixed 29500", port=port)


def master_endpoint(env: Mapping[str, str]) -> Check:
    """What env:// would use: the address must resolve; the port must be free where the store
    will listen (this host, rank 0) and reachable from everywhere else."""
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    port_text = env.get("MASTER_PORT", "")
    where = f"MASTER_ADDR={addr}" + (f" MASTER_PORT={port_text}" if port_text else "")
    try:
        addrs = _resolve(addr)
    except OSError as e:
        return fail("master", f"{where}: {addr} does not resolve ({e.strerror or e})",
                    "a typo, or a name known only inside the cluster (its DNS or /etc/hosts)",
                    "set MASTER_ADDR to the rank-0 node's IP or a name `getent hosts NAME` "
                    "resolves (127.0.0.1 on one node)", addresses=[])
    if not port_text.isdigit():
        return ok("master", f"{where} resolves to {', '.join(addrs)} (no valid MASTER_PORT to "
                  "test)", addresses=addrs)
    port = int(port_text)
    if not 1 <= port <= 65535:
        return fail("master", f"{where}: port {port} is out of range",
                    "TCP ports are 1-65535", "pick a port in 1024-65535", addresses=addrs)
    local = any(_is_local(a) for a in addrs)
    hosts_store = local and env.get("RANK", "0") == "0" and env.get("GROUP_RANK", "0") == "0"
    if hosts_store:
        return _bindable(where, port, addrs)
    return _reachable(where, addrs[0], port, addrs)


def _is_local(address: str) -> bool:
    """An address of this host: one we can bind to."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _bindable(where: str, port: int, addrs: list[str]) -> Check:
    # The c10d TCPStore listens on every interface with SO_REUSEADDR; do the same.
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return fail("master", f"{where}: port {port} is already in use on this host",
                        "another job, or a previous run that has not exited, listens on it; the "
                        "rank-0 store cannot start ('EADDRINUSE')",
                        f"export MASTER_PORT={_a_free_port()} (a port the OS reports free now), "
                        f"or stop the holder: ss -ltnp 'sport = :{port}'", addresses=addrs)
        if e.errno == errno.EACCES:
            return fail("master", f"{where}: binding port {port} is not permitted",
                        "ports below 1024 need root", "pick a port in 1024-65535",
                        addresses=addrs)
        return fail("master", f"{where}: cannot bind port {port}: {e}",
                    "the store on this host could not listen", "pick another MASTER_PORT",
                    addresses=addrs)
    role = "this host (rank 0) would host the store"
    return ok("master", f"{where}: resolves to {', '.join(addrs)}; {role}; port {port} is free",
              addresses=addrs, role="host")


def _reachable(where: str, address: str, port: int, addrs: list[str]) -> Check:
    try:
        with socket.create_connection((address, port), timeout=3):
            pass
    except ConnectionRefusedError:
        return warn("master", f"{where}: nothing listens on {address}:{port} yet",
                    "rank 0 has not started its store yet, or MASTER_PORT differs between nodes",
                    "start rank 0 (the other ranks wait for it until the rendezvous timeout); use "
                    "the same MASTER_ADDR/MASTER_PORT on every node", addresses=addrs)
    except OSError as e:
        return fail("master", f"{where}: cannot reach {address}:{port} ({e})",
                    "a firewall drops the traffic, or the address is not routable from here",
                    f"open TCP port {port} (and the ephemeral range) between the nodes; "
                    "check with nc -zv HOST PORT", addresses=addrs)
    return ok("master", f"{where}: {address}:{port} accepts connections (the rank-0 store, "
              "if it has started)", addresses=addrs, role="client")


def _a_free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
