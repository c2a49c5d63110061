"""Which sandbox processes a test process answers for, when other test processes run sandboxes beside it
(python -m pytest -n 2: another worker's runs are alive while this one checks that nothing outlived its own)."""
import glob
import os
import re

import sandbox

RUN_CGROUP = re.compile(rf"/{re.escape(sandbox.CGROUP_PARENT)}/(\d+)_")    # <hierarchy>/ma_sandbox/<trainer pid>_<n>_...


def read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def is_sandbox_child(pid):
    """A sandbox child, or the `unshare` that starts one: its command line holds the child's code."""
    cmdline = read(f"/proc/{pid}/cmdline", "rb")
    return cmdline is not None and sandbox.CHILD.encode() + b"\0--" in cmdline


def trainer_of(pid):
    """The pid of the trainer whose run cgroup holds process `pid`, or None (not in a run cgroup: the `unshare`
    before it, a child before it joins its own, a machine without them, or a process that got out)."""
    found = RUN_CGROUP.search(read(f"/proc/{pid}/cgroup") or "")
    return int(found.group(1)) if found else None


def owner_of(pid):
    """The trainer a sandbox process belongs to: the one named by its run cgroup, else its first ancestor that
    is not a sandbox process (the trainer that started it; init or a subreaper for an orphan)."""
    trainer = trainer_of(pid)
    while trainer is None:
        stat = read(f"/proc/{pid}/stat")
        if stat is None:
            return None
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if not is_sandbox_child(pid):
            return pid
    return trainer


def runs_now(trainer):
    """Whether `trainer` is alive and holds a run cgroup: a trainer whose runs are going on."""
    return os.path.exists(f"/proc/{trainer}") and bool(
        glob.glob(f"/sys/fs/cgroup/*/{sandbox.CGROUP_PARENT}/{trainer}_*")
        + glob.glob(f"/sys/fs/cgroup/{sandbox.CGROUP_PARENT}/{trainer}_*"))


def leftover_processes():
    """Sandbox processes (whatever uid they run as) this test process answers for: every one but those of
    another trainer whose runs are going on. A process of this process's runs, of a trainer that is gone (a
    trainer subprocess the test started) or of no trainer at all (an orphan) counts."""
    me = os.getpid()
    found = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        if pid != me and is_sandbox_child(pid):
            owner = owner_of(pid)
            if owner is None or owner == me or not runs_now(owner):
                found.append(pid)
    return found
