"""The CPU seconds a tree of processes uses over a window, sampled from /proc (Linux).

`TreeCPU().start(roots)` opens a window over the processes of `roots`: the roots, their
descendants, and every process in the session of one of them (a server started in a session
of its own, and what it starts, still counts). A thread samples each member's user + system
time every `interval_s`; `stop()` returns the sum over members of (last sample - their time
when the window opened, 0 for processes born in it). A process's CPU in its last
`interval_s` before it exits can be missed; a member's children stay members after it exits.
"""

from __future__ import annotations

import os
import threading

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, float, int] | None:
    """ppid, session, user + system seconds, start time (ticks) of `pid`; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()
    # fields[0] is state (stat field 3): ppid 4, session 6, utime 14, stime 15, starttime 22
    return (
        int(fields[1]),
        int(fields[3]),
        (int(fields[11]) + int(fields[12])) / TICK,
        int(fields[19]),
    )


def _name(pid: int) -> str:
    """A process's name: a NeMo Gym server's folder, else the first argument of its command
    line that names a script, else its executable's name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid} (gone)"
    if "/.venv/bin/" in args[0]:  # a NeMo Gym server: its venv sits in its folder
        server = args[0].split("/.venv/bin/")[0].split("/")[-1]
        return f"{server} {' '.join(args[1:2])}".strip()
    for arg in args[1:]:
        if arg.endswith(".py") or "/bin/" in arg:
            return "/".join(arg.split("/")[-3:])
    return os.path.basename(args[0]) or f"pid {pid}"


def snapshot(roots: tuple[int, ...]) -> dict[tuple[int, int], float]:
    """CPU seconds of every process of the roots' tree, keyed by (pid, start time)."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _stat(int(name))
            if found is not None:
                stats[int(name)] = found
    members = {r for r in roots if r in stats}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, session, _, _) in stats.items():
            if pid not in members and (ppid in members or session in members):
                members.add(pid)
                grew = True
    return {(pid, stats[pid][3]): stats[pid][2] for pid in members}


class TreeCPU:
    """A window of CPU over a tree of processes (module docstring)."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.roots: tuple[int, ...] = ()
        self.base: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.names: dict[tuple[int, int], str] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, roots: tuple[int, ...]) -> None:
        self.roots = roots
        self.base = snapshot(roots)
        self.last = dict(self.base)
        self._done.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self.last.update(snapshot(self._known()))
            for key in self.last.keys() - self.names.keys():
                self.names[key] = _name(key[0])

    def _known(self) -> tuple[int, ...]:
        """The roots and every member seen so far (whose children stay members after it)."""
        return (*self.roots, *{pid for pid, _ in self.last})

    def stop(self, leave_out: int | None = None) -> float:
        """The window's CPU seconds, the process `leave_out` (counted exactly elsewhere) not
        among them."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(10)
        self.last.update(snapshot(self._known()))
        return sum(
            cpu - self.base.get(key, 0.0) for key, cpu in self.last.items() if key[0] != leave_out
        )

    def by_process(self) -> dict[str, float]:
        """The last window's CPU seconds by process, each named by its command line (the
        script or app it runs), largest first."""
        out: dict[str, float] = {}
        for key, cpu in self.last.items():
            name = self.names.get(key) or _name(key[0])
            out[name] = out.get(name, 0.0) + cpu - self.base.get(key, 0.0)
        return dict(sorted(out.items(), key=lambda x: -x[1]))
