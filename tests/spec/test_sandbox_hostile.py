"""sandbox.py against a hostile program, class by class: the trusted side always ends in a verdict at a
bounded cost, a run dies whole, limits are per run, nothing is shared between runs or with the trainer,
and nothing of the host is visible. Honest idioms of contest code pass.

Every hostile program stays harmless if containment fails: fork and thread loops are capped, memory
attempts are modest and short-lived, no file is written outside the program's own tmp, and the only
network peer is none (the network tests live in test_sandbox.py). Syscall numbers are x86-64."""
import os
import platform
import subprocess
import sys
import threading
import time

import pytest

import sandbox
from sandbox_runs import leftover_processes, owner_of

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() != "x86_64",
                                reason="syscall numbers and namespaces of Linux x86-64")

ADD = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
PATIENT = sandbox.Limits(timeout=30.0, cpu_seconds=20, memory_mb=256)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.abspath(sandbox.__file__)
CGROUP_PARENT = getattr(sandbox, "CGROUP_PARENT", "ma_sandbox")
# ctypes back, past the in-process guard (which is an extra layer, not a boundary)
CTYPES = ("import sys\nfor m in ('ctypes', '_ctypes'):\n    sys.modules.pop(m, None)\nimport ctypes\n"
          "libc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n")


# every fd from 3 on pointed at /dev/null, read-only: whatever the sandbox's own code writes after the program is lost
SILENCE = ("null = os.open('/dev/null', os.O_RDONLY)\nfor fd in range(3, 30):\n    if fd != null:\n        try:\n"
           "            os.fstat(fd)\n            os.dup2(null, fd)\n        except OSError:\n            pass\n")


def need(*layers):
    """Skip where a layer this test relies on does not hold on the machine (`sandbox.py --check` names them)."""
    prefix, drop, kind, seccomp, _ = sandbox.isolation()
    held = {"namespaces": bool(prefix), "uid": drop, "cgroup": bool(kind), "seccomp": seccomp}
    missing = [layer for layer in layers if not held[layer]]
    if missing:
        pytest.skip("needs " + ", ".join(missing))


def says(text):
    """Tests under which a program that prints `text` passes."""
    return {"inputs": [""], "outputs": [text]}


def test_a_test_process_answers_for_its_own_runs_not_for_a_live_neighbours():
    """leftover_processes, which every "outlived its run" check reads: a process of this trainer's run counts here
    while it runs, and not in another live process (a second pytest worker) looking at the same machine."""
    need("cgroup")
    done = threading.Thread(target=sandbox.run, args=("import time\ntime.sleep(3)\n", says(""), PATIENT))
    done.start()
    try:
        while not leftover_processes() and done.is_alive():     # no wall-clock limit: seen while it sleeps
            time.sleep(0.05)
        mine = leftover_processes()
        assert mine and all(owner_of(pid) == os.getpid() for pid in mine)
        neighbour = subprocess.run([sys.executable, "-c", "from sandbox_runs import leftover_processes\n"
                                    "print(leftover_processes())"], capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "spec")])})
        assert neighbour.returncode == 0 and neighbour.stdout.strip() == "[]", neighbour.stdout + neighbour.stderr
    finally:
        done.join()
    assert not leftover_processes()


def key_count(uids):
    """Keys the kernel holds for the users in `uids` (/proc/key-users: 'uid: usage nkeys/nikeys ...')."""
    count = 0
    for line in open("/proc/key-users"):
        head, _, rest = line.partition(":")
        if head.strip().isdigit() and int(head) in uids:
            count += int(rest.split()[1].split("/")[0])
    return count


@pytest.fixture(scope="module", autouse=True)
def nothing_is_left_behind():
    """After the module: no process of the sandbox, no cgroup, tmp folder or key of this process's runs."""
    import glob
    import tempfile
    uids = getattr(sandbox, "RUN_UIDS", [sandbox.Limits().uid])
    keys = key_count(uids)
    folders = set(glob.glob(os.path.join(tempfile.gettempdir(), f"sandbox_{os.getpid()}_*")))
    yield
    time.sleep(0.5)
    assert not leftover_processes(), "a process of the sandbox outlived its run"
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), f"sandbox_{os.getpid()}_*"))) <= folders
    assert not glob.glob(f"/sys/fs/cgroup/*/{CGROUP_PARENT}/{os.getpid()}_*") + glob.glob(
        f"/sys/fs/cgroup/{CGROUP_PARENT}/{os.getpid()}_*"), "a cgroup of a run was left behind"
    assert key_count(uids) <= keys, "a key of a sandbox uid was left behind"


# ---------------------------------------------------------------- the trusted side is total

def test_bytes_on_the_report_channel_end_in_a_verdict_never_an_exception():
    """A line that parses as a literal but decodes to an unhashable dict key, on every fd the program
    holds, which then all point to /dev/null, so that this line is the last one."""
    forged = "{'results': [{'out': {'dict': [[[1], 2]]}}, {'out': {'dict': [[[1], 2]]}}]}"
    program = ("import os, signal\nfor fd in range(1, 30):\n    try:\n"
               f"        os.write(fd, b\"{forged}\\n\")\n    except OSError:\n        pass\n" + SILENCE)
    r = sandbox.run(program, ADD, PATIENT)
    assert r.outcome != "passed" and r.reward < 0, r


def test_a_flood_on_the_report_channel_costs_the_trusted_side_one_parse(monkeypatch):
    """30,000 short lines, then silence: parsing may not grow with what the program writes."""
    calls = []
    real = sandbox.parse_report
    monkeypatch.setattr(sandbox, "parse_report", lambda line: calls.append(1) or real(line))
    program = ("import os, signal\nfor fd in range(3, 30):\n    try:\n        os.write(fd, b'0\\n' * 30000)\n"
               "    except OSError:\n        pass\n" + SILENCE)
    r = sandbox.run(program, says("x"), PATIENT)
    assert r.outcome != "passed", r
    assert len(calls) <= 2, f"{len(calls)} lines parsed"


# ---------------------------------------------------------------- one kill for everything a run started

def test_no_process_outlives_its_run_after_leaving_the_process_group():
    """The program tries to leave the process group (setpgrp through a fresh `posix`) and spins for at
    most 10 s; the run times out after 1.5 s, and nothing of it may be left."""
    need('cgroup')
    program = ("import sys, time\ndel sys.modules['posix']\nimport posix\ntry:\n    posix.setpgrp()\n"
               "except OSError:\n    pass\nt = time.time()\nwhile time.time() - t < 10:\n    pass\n")
    r = sandbox.run(program, says("x"), sandbox.Limits(timeout=1.5, cpu_seconds=20))
    assert r.outcome == "timeout"
    time.sleep(0.3)
    assert not leftover_processes(), "a process of the program outlived its run"


def test_no_forked_process_outlives_its_run():
    """fork restored by a fresh `posix`, the child in a session of its own, spinning for at most 10 s."""
    need('namespaces')
    program = ("import sys, time\ndel sys.modules['posix']\nimport posix\n"
               "if posix.fork() == 0:\n    try:\n        posix.setsid()\n    except OSError:\n        pass\n    t = time.time()\n"
               "    while time.time() - t < 10:\n        pass\n")
    sandbox.run(program, says("x"), PATIENT)
    time.sleep(0.3)
    assert not leftover_processes(), "a forked process of the program outlived its run"


# ---------------------------------------------------------------- limits per run

def test_memory_outside_the_address_space_is_charged_to_the_run():
    """Up to 320 files of 1 MiB in its working folder (its tmpfs /tmp; below RLIMIT_FSIZE each, outside RLIMIT_AS)
    under a 128 MiB run, open-files limit raised, each held open: the run's memory (its cgroup, and its /tmp's size)
    must stop it."""
    need('cgroup')
    program = ("import os\nfds = []\nfor i in range(320):\n    fd = os.open(f'm{i}', os.O_RDWR | os.O_CREAT)\n"
               "    os.write(fd, b'x' * (1 << 20))\n    fds.append(fd)\nprint('held')\n")
    limits = sandbox.Limits(timeout=30, cpu_seconds=20, memory_mb=128, open_files=1024)   # memory, not fds, stops it
    r = sandbox.run(program, says("held"), limits)
    assert r.outcome != "passed", r
    r = sandbox.run(program.replace("320", "64"), says("held"), limits)
    assert r.outcome == "passed", r                                   # 64 MiB of them is within the run's memory


def test_open_files_are_limited_per_run():
    """1,000 descriptors of /dev/null (bounded memory in the kernel, but a cost outside every limit)."""
    program = "import os\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(1000)]\nprint('held')\n"
    r = sandbox.run(program, says("held"), PATIENT)
    assert r.outcome == "runtime_error" and "Too many open files" in r.detail, r


def test_a_run_holding_its_threads_cannot_make_a_concurrent_run_fail():
    """Run A starts threads until it cannot (at most 150) and holds them for 6 s; run B, starting its
    threads 2 s in, must still pass."""
    need('cgroup')
    hog = ("import threading, time\nthreading.stack_size(1 << 16)\nhold = threading.Event()\nn = 0\nfor _ in range(150):\n    try:\n"
           "        threading.Thread(target=hold.wait, args=(6,), daemon=True).start()\n        n += 1\n"
           "    except RuntimeError:\n        break\ntime.sleep(6)\nprint(n)\n")
    honest = ("import threading, time\ntime.sleep(2)\nout = []\n"
              "ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n"
              "[t.start() for t in ts]\n[t.join() for t in ts]\nprint(len(out))\n")
    limits = sandbox.Limits(timeout=30, cpu_seconds=20, memory_mb=512)
    results = {}
    hog_thread = threading.Thread(target=lambda: results.update(hog=sandbox.run(hog, says("x"), limits)))
    hog_thread.start()
    time.sleep(0.5)
    results["honest"] = sandbox.run(honest, says("8"), limits)
    hog_thread.join()
    assert results["honest"].outcome == "passed", results["honest"]


# ---------------------------------------------------------------- nothing shared

KEY_NOTE = (CTYPES + "KEYCTL_SEARCH = 10\n"
            "found = libc.syscall(250, KEYCTL_SEARCH, -4, b'user', b'sandbox_note', 0)\n"
            "if found > 0:\n    print('found')\n    libc.syscall(250, 9, -4, found)\n"       # KEYCTL_UNLINK
            "else:\n    print('added' if libc.syscall(248, b'user', b'sandbox_note', b'1', 1, -4) > 0 else 'no')\n")


def test_no_note_kept_in_a_keyring_reaches_a_later_run():
    """A deterministic program keeps a note in the sandbox uid's user keyring; a later run reads it (and
    removes it). Both runs must fail to reach the keyring."""
    need('seccomp')
    first = sandbox.run(KEY_NOTE, says("added"), PATIENT)
    second = sandbox.run(KEY_NOTE, says("found"), PATIENT)
    assert first.outcome != "passed" and second.outcome != "passed", (first, second)


def test_the_trainers_session_keyring_is_out_of_reach():
    """A trainer keeps a secret in its session keyring; the program searches its session keyring."""
    need('namespaces')
    steal = (CTYPES + "key = libc.syscall(250, 10, -3, b'user', b'trainer_secret', 0)\n"
             "buf = ctypes.create_string_buffer(64)\nn = libc.syscall(250, 11, key, buf, 64) if key > 0 else -1\n"
             "print(buf.raw[:n].decode() if n > 0 else 'no')\n")
    trainer = ("import ctypes, sys\nlibc = ctypes.CDLL(None)\nlibc.syscall.restype = ctypes.c_long\n"
               "assert libc.syscall(250, 1, None) > 0\n"                        # a session keyring of its own
               "assert libc.syscall(248, b'user', b'trainer_secret', b'hunter2', 7, -3) > 0\n"
               "import sandbox\nr = sandbox.run(sys.argv[1], {'inputs': [''], 'outputs': ['hunter2']},"
               " sandbox.Limits(timeout=30, cpu_seconds=20))\nprint(r.outcome)\n")
    proc = subprocess.run([sys.executable, "-c", trainer, steal], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] != "passed"


@pytest.mark.parametrize("name, call", [
    ("unshare(CLONE_NEWUSER)", "libc.syscall(272, 0x10000000)"),
    ("ptrace(PTRACE_TRACEME)", "libc.syscall(101, 0, 0, 0, 0)"),
    ("perf_event_open", "libc.syscall(298, ctypes.create_string_buffer(128), 0, -1, -1, 0) * 0"),
    ("socket(AF_VSOCK): past the network namespace, to a virtual machine's host", "min(0, libc.syscall(41, 40, 1, 0))"),
    # the kernel broadcasts the host's device events to every network namespace of the host's user namespace
    ("socket(AF_NETLINK, NETLINK_KOBJECT_UEVENT): the host's device events", "min(0, libc.syscall(41, 16, 3, 15))"),
    ("socket(AF_NETLINK, NETLINK_SOCK_DIAG): its dumps carry socket cookies (a host-wide counter)",
     "min(0, libc.syscall(41, 16, 3, 4))"),
    ("preadv2(RWF_NOWAIT): whether a page of os.py is cached (another run may have read it)",
     "__import__('os').preadv(__import__('os').open(__import__('os').__file__, 0), [bytearray(8)], 0, 8) * 0"),
    # counts the kernel keeps for the whole host, scoped by no namespace or uid: a run raises one in proportion to a
    # secret and a concurrent run reads it, or a run uses one up for the trainer (each call here takes one unit)
    ("io_setup: a slot of the host's asynchronous I/O (aio-nr)", "libc.syscall(206, 1, ctypes.byref(ctypes.c_ulong(0)))"),
    ("pidfd_open: a pidfd's inode number counts the processes the host has started",
     "min(0, libc.syscall(434, __import__('os').getpid(), 0))"),
    ("statx's unique mount id: counts the mounts the host has made (a dozen a run)",
     "libc.syscall(332, -100, b'/', 0, 0x4000, ctypes.create_string_buffer(256))"),
    ("statx's mount id", "libc.syscall(332, -100, b'/', 0, 0x1000, ctypes.create_string_buffer(256))"),
    ("listmount: the mount ids", "min(0, libc.syscall(458, (ctypes.c_uint64 * 3)(24, 2 ** 64 - 1, 0), "
                                 "(ctypes.c_uint64 * 8)(), 8, 0))"),
    ("getsockopt(SO_NETNS_COOKIE): counts the network namespaces the host has made (one a run)",
     "__import__('socket').socket(1).getsockopt(1, 71, 8) and 0"),
    ("getsockopt(SO_COOKIE): one counter for every socket of the host", "__import__('socket').socket(1).getsockopt(1, 57, 8) and 0"),
    ("clock_adjtime: the host's clock discipline", "min(0, libc.syscall(305, 0, ctypes.create_string_buffer(256)))"),
    ("memfd_create: a memfd's inode number counts the memfds and shared memory the host has made",
     "min(0, libc.memfd_create(b'x', 0))"),
    ("pipe: a pipe's inode number counts the pipes and sockets the host has made", "len(__import__('os').pipe()) * 0"),
    ("socketpair(AF_UNIX): the same counter", "len(__import__('socket').socketpair()) * 0"),
    ("socket(AF_UNIX): the same counter", "min(0, libc.syscall(41, 1, 1, 0))"),
    ("mq_open: a message queue's inode number, the same counter (removed at once)",
     "min(0, [libc.syscall(240, b'sandbox_q', 0o100 | 2, 0o600, None), libc.syscall(241, b'sandbox_q')][0])"),
    ("mmap(MAP_HUGETLB): the host's pool of huge pages (here none: ENOMEM, not EPERM)",
     "(setattr(libc.mmap, 'argtypes', [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]) "
     "or libc.mmap(None, 2 << 20, 3, 0x40022, -1, 0)) and 0"),
    ("O_DIRECT: reads from the host's disk past its cache",
     "min(0, __import__('os').open(__import__('os').__file__, __import__('os').O_RDONLY | __import__('os').O_DIRECT))"),
])
def test_syscalls_a_test_program_never_needs_are_denied(name, call):
    """Each syscall's own return value: 0 (or, for perf_event_open, any return but EPERM) is a pass."""
    need('seccomp')
    program = CTYPES + f"r = {call}\nerr = ctypes.get_errno()\nprint('ok' if r == 0 and err != 1 else 'denied')\n"
    r = sandbox.run(program, says("ok"), PATIENT)
    assert r.outcome != "passed", (name, r)


# Two concurrent runs of one batch, a sender and a receiver: the receiver prints "seen" if the sender's
# signal crossed over through an inode both runs see (the standard library's os.py). Each side stops by
# itself within a few seconds.
OS_PY = "import os\npath = os.__file__\n"
SENDERS = {
    "flock": OS_PY + "import fcntl, time\nf = open(path, 'rb')\nfcntl.flock(f, fcntl.LOCK_SH)\ntime.sleep(5)\nprint('x')\n",
    "fcntl record lock": OS_PY + "import fcntl, time\nf = open(path, 'rb')\nfcntl.lockf(f, fcntl.LOCK_SH, 1, 7)\n"
                                 "time.sleep(5)\nprint('x')\n",
    "inotify": OS_PY + "import time\nt = time.time()\nwhile time.time() - t < 5:\n    open(path, 'rb').close()\n"
                       "    time.sleep(0.05)\nprint('x')\n",
    "shared futex": CTYPES + OS_PY + "import time\nlibc.mmap.restype = ctypes.c_void_p\n"
                    "f = open(path, 'rb')\naddr = libc.mmap(None, 4096, 1, 2, f.fileno(), 0)\nt = time.time()\n"
                    "while time.time() - t < 5:\n    libc.syscall(202, ctypes.c_void_p(addr), 1, 1, None, None, 0)\n"
                    "    time.sleep(0.01)\nprint('x')\n",
}
RECEIVERS = {
    "flock": OS_PY + "import fcntl, time\nf = open(path, 'rb')\nseen = False\nt = time.time()\n"
                     "while not seen and time.time() - t < 4:\n    try:\n        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                     "        fcntl.flock(f, fcntl.LOCK_UN)\n    except BlockingIOError:\n        seen = True\n"
                     "    time.sleep(0.05)\nprint('seen' if seen else 'no')\n",
    "fcntl record lock": OS_PY + "import fcntl, struct, time\nf = open(path, 'rb')\nseen = False\nt = time.time()\n"
                                 "while not seen and time.time() - t < 4:\n"
                                 "    got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 7, 1, 0))\n"
                                 "    seen = struct.unpack('hhqqi4x', got)[0] != fcntl.F_UNLCK\n    time.sleep(0.05)\n"
                                 "print('seen' if seen else 'no')\n",
    "inotify": CTYPES + OS_PY + "import select\nfd = libc.inotify_init1(0)\n"
                                "ok = fd >= 0 and libc.inotify_add_watch(fd, path.encode(), 0x20) >= 0\n"
                                "print('seen' if ok and select.select([fd], [], [], 4)[0] else 'no')\n",
    "shared futex": CTYPES + OS_PY + "libc.mmap.restype = ctypes.c_void_p\nf = open(path, 'rb')\n"
                    "addr = libc.mmap(None, 4096, 1, 2, f.fileno(), 0)\nvalue = ctypes.c_uint32.from_address(addr).value\n"
                    "timeout = (ctypes.c_long * 2)(4, 0)\n"
                    "r = libc.syscall(202, ctypes.c_void_p(addr), 0, value, timeout, None, 0)\n"
                    "print('seen' if r == 0 else 'no')\n",
}


@pytest.mark.parametrize("channel", list(SENDERS))
def test_concurrent_runs_cannot_pass_a_signal_through_a_shared_inode(channel):
    """Locks (flock, fcntl record locks), inotify watches and futexes keyed by a file's inode: a sender holds
    or pokes os.py, a concurrent receiver in the same run_many batch looks for it."""
    need("namespaces", "seccomp")
    results = sandbox.run_many([(SENDERS[channel], says("x")), (RECEIVERS[channel], says("seen"))], PATIENT, workers=2)
    assert results[1].outcome != "passed", (channel, results)


def test_concurrent_runs_share_no_per_user_count():
    """The kernel counts tasks per user: a sender holds 8 threads for 4 s; a concurrent receiver (2 tasks of its
    own) lowers its own limit on its user's tasks to 6 and starts a thread, which fails if the sender's threads
    count as its user's (one uid for every run). A thread reserves a malloc arena of the address space: 1 GiB."""
    need("uid", "cgroup")
    sender = ("import threading, time\nhold = threading.Event()\nthreading.stack_size(1 << 16)\n"
              "for _ in range(8):\n    threading.Thread(target=hold.wait, args=(4,), daemon=True).start()\n"
              "time.sleep(4)\nprint('x')\n")
    receiver = ("import resource, threading, time\ntime.sleep(1.5)\n"
                "resource.setrlimit(resource.RLIMIT_NPROC, (6, resource.getrlimit(resource.RLIMIT_NPROC)[1]))\n"
                "try:\n    threading.Thread(target=int).start()\n    print('no')\nexcept RuntimeError:\n    print('seen')\n")
    limits = sandbox.Limits(timeout=30.0, cpu_seconds=20)
    results = sandbox.run_many([(sender, says("x")), (receiver, says("seen"))], limits, workers=2)
    assert results[0].outcome == "passed" and results[1].outcome != "passed", results


def test_forked_workers_share_the_runs_cpu_budget():
    """Three processes (fork restored by a fresh `posix`), each spinning for at most 0.8 s of its own CPU,
    under a budget of 1 s for the run: together 2.4 s, so the run may not pass."""
    need("seccomp")
    program = ("import sys, time\ndel sys.modules['posix']\nimport posix\n"
               "def spin():\n    t = time.time()\n    while time.process_time() < 0.8 and time.time() - t < 10:\n"
               "        pass\nkids = []\nfor _ in range(2):\n    pid = posix.fork()\n    if pid == 0:\n        spin()\n"
               "        posix._exit(0)\n    kids.append(pid)\nspin()\nfor pid in kids:\n    posix.waitpid(pid, 0)\n"
               "print('done')\n")
    r = sandbox.run(program, says("done"), sandbox.Limits(timeout=30, cpu_seconds=1))
    assert r.outcome != "passed", r


def test_a_run_cannot_make_the_host_write_back_its_dirty_pages(tmp_path):
    """sync() and syncfs() need no privilege: a program wrote back the host's dirty pages. The test
    dirties 8 MiB of a file of its own, a program calls sync, syncfs, fsync, fdatasync, sync_file_range and msync on
    what it can reach, and the file's pages must still be dirty (cachestat: the kernel's count of a file's dirty
    pages). They return 0, as an honest program expects: everything a run may write is in memory."""
    need("seccomp")
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def dirty_pages(fd):                                     # cachestat(fd, range, cstat, 0): nr_dirty is the second
        stat = (ctypes.c_uint64 * 5)()
        if libc.syscall(451, fd, (ctypes.c_uint64 * 2)(0, 0), stat, 0) != 0:
            pytest.skip(f"no cachestat on this kernel (errno {ctypes.get_errno()})")
        return stat[1]
    fd = os.open(tmp_path / "dirty", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, os.urandom(8 << 20))
        if dirty_pages(fd) < 1024:
            pytest.skip("the test's folder keeps no dirty pages (a tmpfs?)")
        program = (CTYPES + "import mmap, os\nfd = os.open(os.__file__, os.O_RDONLY)\nos.sync()\n"
                   "rs = [libc.syncfs(fd), libc.syscall(306, os.open('/', os.O_RDONLY)), libc.fsync(fd), libc.fdatasync(fd),\n"
                   "      libc.syscall(277, fd, 0, 0, 7)]\n"
                   "m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)\nm.flush()\n"
                   "with open('/tmp/x', 'w') as f:\n    f.write('1')\n    f.flush()\n    os.fsync(f.fileno())\n"
                   "print('ok' if rs == [0] * 5 else rs)\n")
        r = sandbox.run(program, says("ok"), PATIENT)
        still = dirty_pages(fd)
        os.fsync(fd)                                         # the measurement works: a real fsync cleans them
        assert dirty_pages(fd) < 1024
    finally:
        os.close(fd)
    assert still >= 1024, f"{still} dirty pages of 2048 left: the run wrote the host's back"
    assert r.outcome == "passed", r


def test_the_hosts_disk_is_out_of_reach():
    """statvfs on the read-only standard library reported the host disk's size and free space, which falls as the
    trainer writes checkpoints (a training clock); /dev/null's reports the host's devtmpfs (half its memory); ustat()
    reports a disk's free space by device number."""
    need("seccomp")
    host = {os.statvfs(path).f_blocks for path in (os.__file__, "/dev/null")}
    program = (CTYPES + "import os\nseen = []\nfor path in (os.__file__, '/dev/null', '/'):\n    try:\n"
               "        seen.append(os.statvfs(path).f_blocks)\n    except OSError:\n        pass\n"
               "if libc.syscall(136, os.stat(os.__file__).st_dev, ctypes.create_string_buffer(64)) == 0:\n"
               "    seen.append('ustat')\n"
               f"print('seen' if set(seen) & set({sorted(host) + ['ustat']!r}) else 'no')\n")
    r = sandbox.run(program, says("seen"), PATIENT)
    assert r.outcome != "passed", r


# A program spinning until it has used `seconds` of CPU (at most 25 s of wall clock), having first raised its soft CPU
# limit to the hard one and / or ignored SIGXCPU through libc (its thread may not set Python handlers).
def spinner(seconds, raise_soft=False, ignore_sigxcpu=False):
    program = CTYPES + "import resource, time\n"
    if raise_soft:
        program += "hard = resource.getrlimit(resource.RLIMIT_CPU)[1]\nresource.setrlimit(resource.RLIMIT_CPU, (hard, hard))\n"
    if ignore_sigxcpu:
        program += "libc.signal(24, ctypes.c_void_p(1))\n"                      # signal(SIGXCPU, SIG_IGN)
    return program + (f"t = time.time()\nwhile time.process_time() < {seconds} and time.time() - t < 25:\n    pass\n"
                      "print('done')\n")


@pytest.mark.parametrize("raise_soft, ignore_sigxcpu", [(True, False), (False, True), (True, True)])
def test_the_cpu_budget_does_not_stretch(raise_soft, ignore_sigxcpu):
    """RLIMIT_CPU was (budget, budget + 1): a process raised its soft limit to the hard one, or ignored SIGXCPU,
    and 1.6 s of CPU under a 1 s budget passed."""
    r = sandbox.run(spinner(1.6, raise_soft, ignore_sigxcpu), says("done"), sandbox.Limits(timeout=30, cpu_seconds=1))
    assert r.outcome == "timeout", r


def test_the_cpu_budget_is_the_cpu_the_trusted_side_measured():
    """The kernel's limit is only a backstop, a second past the budget (rounded up): with a budget of 1.3 s, a
    program using 1.8 s is stopped by the trusted side, which reads the run's CPU time (its cgroup, wait4) and
    decides; one using 0.5 s passes."""
    limits = sandbox.Limits(timeout=30, cpu_seconds=1.3)
    assert sandbox.run(spinner(1.8, raise_soft=True), says("done"), limits).outcome == "timeout"
    r = sandbox.run(spinner(0.5), says("done"), limits)
    assert r.outcome == "passed", r


def test_a_trickle_of_bytes_costs_the_trusted_side_a_bounded_number_of_reads(monkeypatch):
    """The program writes one byte at a time to every pipe it holds (the report, the saved stderr), each once the
    last was read (FIONREAD says the pipe is empty), for 3 s: each byte woke the trusted side (0.8 s of the trainer's
    CPU for one run; 28,000 to 64,000 reads here). Its reads are counted: past FREE_SMALL_READS small wakeups, one
    wakeup per READ_PACE at most, each reading the pipes that are ready (the program holds two)."""
    reads = []
    real = sandbox._read
    monkeypatch.setattr(sandbox, "_read", lambda fd: reads.append(fd) or real(fd))
    program = ("import fcntl, os, stat, termios, time\npipes = []\nfor fd in range(3, 64):\n    try:\n"
               "        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n            os.set_blocking(fd, False)\n"
               "            pipes.append(fd)\n    except OSError:\n        pass\nt = time.time()\n"
               "while pipes and time.time() - t < 3:\n    for fd in list(pipes):\n        try:\n            os.write(fd, b' ')\n"
               "        except OSError:\n            pipes.remove(fd)\n"
               "    for fd in pipes:\n        while time.time() - t < 3 and fcntl.ioctl(fd, termios.FIONREAD, b'    ') != bytes(4):\n"
               "            pass\nprint('x')\n")
    limits = sandbox.Limits(timeout=5, cpu_seconds=5)
    sandbox.run(program, says("x"), limits)
    bound = 2 * (sandbox.FREE_SMALL_READS + limits.timeout / sandbox.READ_PACE) + 10
    assert 20 < len(reads) <= bound, f"{len(reads)} reads (at most {bound:.0f})"


def test_the_programs_stdin_and_stdout_are_files_of_its_own_tmp():
    """A memfd's inode number comes from one counter of the host's: the program's fd 0 and fd 1 were memfds, and
    their numbers rose by three every run (a training clock). In the run's own tmpfs the numbers are its own (pipes
    and sockets share another counter of the host's: the program may make none, and the report pipe's number is
    still the host's, not closed). A FIFO in /tmp is a pipe with a number of the run's own."""
    need("namespaces")
    program = "import os\ntmp = os.stat('/tmp').st_dev\nprint(os.fstat(0).st_dev == tmp and os.fstat(1).st_dev == tmp)\n"
    r = sandbox.run(program, {"inputs": ["1", "2"], "outputs": ["True", "True"]}, PATIENT)
    assert r.outcome == "passed", r
    fifo = ("import os\nos.mkfifo('/tmp/f')\nr = os.open('/tmp/f', os.O_RDONLY | os.O_NONBLOCK)\n"   # a pipe of its own
            "w = os.open('/tmp/f', os.O_WRONLY)\nos.write(w, input().encode())\nprint(os.read(r, 9).decode())\n")
    assert sandbox.run(fifo, {"inputs": ["ok"], "outputs": ["ok"]}, PATIENT).outcome == "passed"


def test_nothing_of_the_trainer_is_in_the_programs_memory():
    """The trainer's pid and run counter (its runs' cgroups are named <pid>_<n>_...), the checkout's and the virtual
    environment's paths: looked for where the interpreter keeps the path it was executed from (AT_EXECFN,
    Py_GetProgramFullPath, Py_GetPrefix, ...) and in every readable page within 32 MiB of the heap, the interpreter's
    objects and the main thread's stack, read through ctypes. A page is readable if pwrite can copy it to a file. Each
    marker arrives as two hex halves, so that the whole never stands in the program's own memory."""
    need("namespaces")
    markers = [f"{CGROUP_PARENT}/{os.getpid()}_", ROOT, sys.prefix]
    halves = [(m[:len(m) // 2].encode().hex(), m[len(m) // 2:].encode().hex()) for m in markers]
    program = (CTYPES + "import os, sys\ndef look():\n"
               f"    halves = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in {halves!r}]\n"
               "    def holds(data):\n        for a, b in halves:\n            i = data.find(a)\n            while i >= 0:\n"
               "                if data[i + len(a):i + len(a) + len(b)] == b:\n                    return True\n"
               "                i = data.find(a, i + 1)\n        return False\n"
               "    libc.getauxval.restype = libc.sbrk.restype = ctypes.c_void_p\n    execfn = libc.getauxval(31)\n"
               "    found = [ctypes.string_at(execfn)] if execfn else []\n"
               "    for name in ('Py_GetProgramFullPath', 'Py_GetPrefix', 'Py_GetExecPrefix', 'Py_GetPath', 'Py_GetProgramName'):\n"
               "        call = getattr(ctypes.pythonapi, name)\n        call.restype = ctypes.c_wchar_p\n"
               "        found.append((call() or '').encode())\n    leaks = [f for f in found if holds(f)]\n"
               "    probe = os.open('probe', os.O_RDWR | os.O_CREAT)\n"
               "    libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]\n"
               "    tail = b''\n    for anchor in {execfn or 0, libc.sbrk(0) or 0, id(sys), id(os.environ), id(look)} - {0}:\n"
               "        start = max(1 << 16, (anchor & ~0xFFFFF) - (32 << 20))\n"
               "        for page in range(start, start + (64 << 20), 4096):\n"
               "            if libc.pwrite(probe, page, 4096, 0) != 4096:\n                tail = b''\n                continue\n"
               "            data = tail + ctypes.string_at(page, 4096)\n            if holds(data):\n"
               "                leaks.append(hex(page))\n            tail = data[-256:]\n    return leaks\n"
               "leaks = look()\nprint('clean' if not leaks else leaks)\n")
    r = sandbox.run(program, says("clean"), sandbox.Limits(timeout=60, cpu_seconds=40, memory_mb=512))
    assert r.outcome == "passed", r


# ---------------------------------------------------------------- nothing of the host is visible

@pytest.mark.parametrize("what, path", [
    ("the project's own files", SCRIPT),
    ("the interpreter's site-packages", os.path.join(sys.base_prefix, "lib",
                                                     f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                                     "site-packages")),
    ("the virtual environment", sys.prefix),
    ("the host's /etc", "/etc"),
])
def test_nothing_of_the_host_is_visible(what, path):
    need('namespaces')
    program = f"import os\np = {path!r}\nprint('seen' if os.path.isdir(p) and os.listdir(p) or open(p).read(1) else 'no')\n"
    r = sandbox.run(program, says("seen"), PATIENT)
    assert r.outcome != "passed", (what, r)


def test_nothing_of_the_trainer_or_the_host_is_in_the_programs_view():
    """The program looks for the trainer's pid (as in its runs' cgroup names), the checkout's path and the host's
    name in its arguments, its interpreter's paths, every module's file, every frame's file and locals, and
    its host name. The markers reach it hex-encoded, so that the job's own text does not contain them."""
    markers = [f"{os.getpid()}_", ROOT, sys.prefix]
    program = ("import os, socket, sys\ndef look():\n"          # in a function: the markers stay out of its globals
               f"    markers = [bytes.fromhex(m).decode() for m in {[m.encode().hex() for m in markers]!r}]\n"
               f"    host = bytes.fromhex({platform.node().encode().hex()!r}).decode()\n"
               "    seen = [*sys.argv, *sys.orig_argv, sys.executable, getattr(sys, '_base_executable', ''), sys.prefix,\n"
               "            sys.exec_prefix, *sys.path, *map(str, sys.path_importer_cache), os.getcwd()]\n"
               "    seen += [str(getattr(m, '__file__', '')) for m in list(sys.modules.values())]\n"
               "    for frame in sys._current_frames().values():\n        while frame is not None:\n"
               "            if frame.f_code.co_filename != '<program>':\n"
               "                seen += [frame.f_code.co_filename] + [repr(v)[:10000] for v in frame.f_locals.values()]\n"
               "            frame = frame.f_back\n"
               "    leaks = [s for s in seen if any(m in s for m in markers)]\n"
               "    leaks += [n for n in (socket.gethostname(), os.uname().nodename) if n == host]\n"
               "    return leaks\nprint('clean' if not look() else 'leak')\n")
    r = sandbox.run(program, says("clean"), PATIENT)
    assert r.outcome == "passed", r


# ---------------------------------------------------------------- honest idioms of contest code pass

# the fast-IO template of many contest solutions (PyRival's): fileno(), mode, os.read and os.write
FAST_IO = '''import os, sys
from io import BytesIO, IOBase
BUFSIZE = 8192
class FastIO(IOBase):
    newlines = 0
    def __init__(self, file):
        self._fd = file.fileno()
        self.buffer = BytesIO()
        self.writable = "x" in file.mode or "r" not in file.mode
        self.write = self.buffer.write if self.writable else None
    def read(self):
        while True:
            b = os.read(self._fd, max(os.fstat(self._fd).st_size, BUFSIZE))
            if not b:
                break
            ptr = self.buffer.tell()
            self.buffer.seek(0, 2), self.buffer.write(b), self.buffer.seek(ptr)
        self.newlines = 0
        return self.buffer.read()
    def readline(self):
        while self.newlines == 0:
            b = os.read(self._fd, max(os.fstat(self._fd).st_size, BUFSIZE))
            self.newlines = b.count(b"\\n") + (not b)
            ptr = self.buffer.tell()
            self.buffer.seek(0, 2), self.buffer.write(b), self.buffer.seek(ptr)
        self.newlines -= 1
        return self.buffer.readline()
    def flush(self):
        if self.writable:
            os.write(self._fd, self.buffer.getvalue())
            self.buffer.truncate(0), self.buffer.seek(0)
class IOWrapper(IOBase):
    def __init__(self, file):
        self.buffer = FastIO(file)
        self.flush = self.buffer.flush
        self.writable = self.buffer.writable
        self.write = lambda s: self.buffer.write(s.encode("ascii"))
        self.read = lambda: self.buffer.read().decode("ascii")
        self.readline = lambda: self.buffer.readline().decode("ascii")
sys.stdin, sys.stdout = IOWrapper(sys.stdin), IOWrapper(sys.stdout)
input = lambda: sys.stdin.readline().rstrip("\\r\\n")
'''


@pytest.mark.parametrize("name, program, given, expected", [
    ("sys.stdin.buffer", "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)\n",
     "1 2\n", "3"),
    ("open(0)", "a, b = map(int, open(0).read().split())\nprint(a + b)\n", "1 2\n", "3"),
    ("readline, then input", "import sys\nn = int(sys.stdin.readline())\nprint(n + int(input()))\n", "1\n2\n", "3"),
    ("sys.stdout.buffer", "import sys\nsys.stdout.buffer.write(b'3\\n')\n", "", "3"),
    ("deep recursion", "import sys\nsys.setrecursionlimit(10 ** 6)\ndef f(n):\n    return n if n == 0 else 1 + f(n - 1)\n"
     "print(f(100000))\n", "", "100000"),
    ("deep recursion through lru_cache", "import sys\nfrom functools import lru_cache\nsys.setrecursionlimit(10 ** 6)\n"
     "@lru_cache(None)\ndef f(n):\n    return n if n == 0 else 1 + f(n - 1)\nprint(f(100000))\n", "", "100000"),
    ("300 KB of output", "print('x' * 300000)\n", "", "x" * 300000),
    ("many lines of output", "print('\\n'.join(map(str, range(50000))))\n", "",
     "\n".join(map(str, range(50000)))),
    # exit() and quit(), os._exit after a flush, output through fd 1, fast-IO templates, fileinput, tempfile
    ('exit()', "print(int(input()) + 1)\nexit()\nprint('never')\n", "2\n", "3"),
    ('quit() in a function', "def main():\n    print(int(input()) + 1)\n    quit()\nmain()\nprint('never')\n", "2\n", "3"),
    ('exit(0) after sys.stdout.write', "import sys\nsys.stdout.write(str(int(input()) + 1) + '\\n')\nexit(0)\n", "2\n", "3"),
    ('os._exit(0) after a flush', 'import os, sys\nprint(int(input()) + 1)\nsys.stdout.flush()\nos._exit(0)\n', "2\n", "3"),
    ('os.write(1, ...)', "import os\nos.write(1, (str(int(input()) + 1) + '\\n').encode())\n", "2\n", "3"),
    ("os.fdopen(sys.stdout.fileno(), 'w')", "import os, sys\nout = os.fdopen(sys.stdout.fileno(), 'w')\nout.write(str(int(input()) + 1) + '\\n')\n", "2\n", "3"),
    ("open(1, 'w') with a large buffer", "out = open(1, 'w', buffering=1 << 16, closefd=False)\nprint(int(input()) + 1, file=out)\nout.flush()\n", "2\n", "3"),
    ('sys.stdout = io.TextIOWrapper(sys.stdout.buffer)', "import io, sys\nsys.stdout = io.TextIOWrapper(sys.stdout.buffer, encoding='utf-8')\nprint(int(input()) + 1)\n", "2\n", "3"),
    ('io.BufferedWriter over fd 1', "import io, sys\nout = io.BufferedWriter(io.FileIO(sys.stdout.fileno(), 'w', closefd=False))\nout.write(b'%d\\n' % (int(input()) + 1))\nout.flush()\n", "2\n", "3"),
    ('the FastIO template', FAST_IO + 'print(int(input()) + 1)\n', "2\n", "3"),
    ("/dev/stdout and /dev/stdin", "import sys\nsys.stdout = open('/dev/stdout', 'w')\nprint(int(open('/dev/stdin').read()) + 1)\n",
     "2\n", "3"),
    ("/dev/fd/0 and /proc/self/fd/1", "data = open('/dev/fd/0', 'rb').read()\nwith open('/proc/self/fd/1', 'w') as out:\n"
     "    out.write(str(int(data) + 1) + '\\n')\n", "2\n", "3"),
    # what CPython does at exit: non-daemon threads joined, atexit functions run, a closed stdout left alone
    ('sys.stdout.close() at the end', 'import sys\nprint(int(input()) + 1)\nsys.stdout.close()\n', "2\n", "3"),
    ('output written by an atexit function, an executor never shut down', 'import atexit, io, sys\nfrom concurrent.futures import ThreadPoolExecutor\nbuffer = io.StringIO()\nsys.stdout = buffer\n@atexit.register\ndef write():\n    sys.__stdout__.write(buffer.getvalue())\npool = ThreadPoolExecutor(2)\nn = int(input())\nprint(pool.submit(lambda: n + 1).result())\n', "2\n", "3"),
    ('main in a thread, not joined', 'import sys, threading\nsys.setrecursionlimit(10 ** 6)\nthreading.stack_size(1 << 25)\ndef main():\n    print(int(input()) + 1)\nthreading.Thread(target=main).start()\n', "2\n", "3"),
    ('fileinput.input()', 'import fileinput\nprint(sum(int(line) for line in fileinput.input()) + 1)\n', "2\n", "3"),
    ("shutil.copy, move and rmtree in a scratch folder", "import os, shutil, tempfile\nd = tempfile.mkdtemp()\nwith open(os.path.join(d, 'a'), 'w') as f:\n    f.write(input())\nshutil.copy(os.path.join(d, 'a'), os.path.join(d, 'b'))\nshutil.move(os.path.join(d, 'b'), os.path.join(d, 'c'))\nprint(int(open(os.path.join(d, 'c')).read()) + 1)\nshutil.rmtree(d)\n", "2\n", "3"),
    # debug prints on stderr, which judges ignore: 1.2 MB per input (print and os.write(2)), past the 1 MiB cap
    ("debug output on stderr past the cap", "import os, sys\nfor i in range(1500):\n    print('debug', i, 'x' * 400, file=sys.stderr)\n"
     "    os.write(2, b'y' * 400 + b'\\n')\nprint(int(input()) + 1)\n", "2\n", "3"),
    ("tempfile and a scratch file in /tmp", "import os, tempfile\nn = int(input())\nwith tempfile.TemporaryDirectory() as d:\n    p = os.path.join(d, 'x.txt')\n    with open(p, 'w') as f:\n        f.write(str(n))\n    a = int(open(p).read())\nwith tempfile.NamedTemporaryFile('w+') as f:\n    f.write('1')\n    f.seek(0)\n    a += int(f.read())\nwith tempfile.TemporaryFile() as f:\n    f.write(b'0')\nwith open('/tmp/scratch.txt', 'w') as f:\n    f.write('0')\na += int(open('/tmp/scratch.txt').read())\nos.remove('/tmp/scratch.txt')\nprint(a)\n", "2\n", "3"),
])
def test_honest_idioms_pass(name, program, given, expected):
    # a thread of the program reserves its stack and a malloc arena (64 MiB) of the address space, freed a little
    # after the thread ends: with threads, the default 1 GiB, as in training, not 256 MiB
    limits = PATIENT if "thread" not in name else sandbox.Limits(timeout=30.0, cpu_seconds=20)
    r = sandbox.run(program, {"inputs": [given, given], "outputs": [expected, expected]}, limits)
    assert r.outcome == "passed", (name, r)


def test_scratch_files_in_tmp_are_private_to_the_run():
    """Two runs of one program, one after the other: each writes /tmp/note and may not find the other's."""
    program = "import os\nprint(os.path.exists('/tmp/note'))\nwith open('/tmp/note', 'w') as f:\n    f.write('x')\n"
    for _ in range(2):
        r = sandbox.run(program, says("False"), PATIENT)
        assert r.outcome == "passed", r


def test_check_names_every_layer_that_holds():
    proc = subprocess.run([sys.executable, "sandbox.py", "--check"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    prefix, drop, kind, seccomp, layers = sandbox.isolation()
    assert all(layer in proc.stdout for layer in layers)
    assert ("per-run cgroup" in proc.stdout) == bool(kind) and ("seccomp filter" in proc.stdout) == seccomp
    assert ("allowlisted root" in proc.stdout) == bool(prefix) and ("UTS namespace" in proc.stdout) == bool(prefix)
    assert ("one process per run" in proc.stdout) == seccomp and ("nothing lockable" in proc.stdout) == seccomp
    assert "one report costs the trusted side" in proc.stdout and "the program's view" in proc.stdout
    assert ("no host-wide count" in proc.stdout) == seccomp and ("the host's disk out of reach" in proc.stdout) == seccomp
    assert "CPU budget decided by the trusted side" in proc.stdout and "a trickle of bytes" in proc.stdout


def test_cgroups_of_a_trainer_that_is_gone_are_removed():
    """A trainer killed mid-run leaves its runs' cgroups (a process of it inside); the next trainer of the
    same PID namespace removes them, and leaves a live trainer's alone."""
    need("cgroup")
    kind = sandbox.isolation()[2]
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = sandbox._Cgroup(kind, sandbox.Limits())
    namespace = sandbox._pid_namespace()
    renamed = [d.replace(f"/{os.getpid()}_", f"/{dead.pid}_") for d in stale.dirs]
    for old, new in zip(stale.dirs, renamed):
        os.rename(old, new)
    spinner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for folder in renamed:
            sandbox._write(folder + "/cgroup.procs", str(spinner.pid))
        live = sandbox._Cgroup(kind, sandbox.Limits())
        sandbox._remove_stale_cgroups(kind)
        assert not any(os.path.exists(d) for d in renamed) and renamed[0].endswith(namespace)
        assert spinner.wait(timeout=10) == -9                           # what was in it was killed
        assert all(os.path.isdir(d) for d in live.dirs)
        live.kill()
    finally:
        spinner.kill()
        spinner.wait()
