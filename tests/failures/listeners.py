"""The TCP listeners of a process and its children, read from /proc (Linux): every socket
in the LISTEN state of ``/proc/net/tcp`` and ``/proc/net/tcp6``, mapped to its owner
through ``/proc/PID/fd``. 0.0.0.0 and :: are not loopback."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

LISTEN = "0A"
Listener = tuple[int, str, str, int]  # pid, command, address, port


def _address(hexaddr: str) -> str:
    """A /proc/net/tcp{,6} address (host-order 32-bit words in hex) as text."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every LISTEN TCP socket of this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == LISTEN:
                host, port = cols[1].split(":")
                found[int(cols[9])] = (_address(host), int(port, 16))
    return found


def _family(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()[:80]
    except OSError:
        return "?"


def listeners_of(root: int) -> list[Listener]:
    """(pid, command, address, port) of every TCP listener of ``root`` and its children."""
    table, out = _listening(), []
    for pid in _family(root):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in table:
                out.append((pid, _command(pid), *table[int(target[8:-1])]))
    return sorted(set(out))


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def beyond_loopback(seen: Sequence[Listener]) -> list[str]:
    """One entry per listener of ``seen`` on an address other than loopback."""
    return [f"pid {pid} ({cmd}) on {addr}:{port}" for pid, cmd, addr, port in sorted(seen) if not loopback(addr)]


def run_watched(cmd: Sequence[str], cwd: str, timeout_s: float = 600,
                every_s: float = 0.5) -> tuple[subprocess.CompletedProcess, set[Listener]]:
    """Run ``cmd`` (stdout and stderr captured, in files: a full pipe would stall it),
    reading its process tree's listeners every ``every_s`` seconds while it runs."""
    seen: set[Listener] = set()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                seen.update(listeners_of(proc.pid))
                time.sleep(every_s)
        finally:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read(), err.read()), seen
