"""Run untrusted generated programs against tests: the execution reward of the code track (App. B.5).

    result = run(program, tests)              # -> Result(outcome, passed, failed, detail)
    result.reward                             # -1.0 compile error, -0.6 runtime error or timeout,
                                              # else -0.3 + 1.3 * passed / (passed + failed)
    results = run_many([(program, tests), ...])   # concurrently, one program per core
    python sandbox.py --check                 # which isolation layers hold on this machine

`tests` is one of three formats:
- APPS standard input / output: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}; outputs are compared
  line by line with trailing whitespace ignored (an input or output stored as a list of lines is those lines);
- APPS call-based: the same with "fn_name" (a function, or a method of `class Solution`) and each input a
  list of arguments;
- HumanEval: {"test": "def check(candidate): ...", "entry_point": "name", "prompt": "..."}; one test,
  failed on AssertionError.

An RL policy learns whatever the reward really measures, so the trusted side decides every verdict and the
untrusted program never holds an expected output, a test's result or the report channel:
- stdin/stdout: the program runs once per input as its own `__main__` module (as `python program.py < input`),
  and its process sends back what it printed for each input; this process compares;
- call-based: the program is imported once as a module of its own and its function called per test (APPS's
  harness); its process receives only the inputs and sends back plain values (None, bool,
  int, float, str and lists / tuples / dicts of them; a subclass, such as a Counter or a named tuple, as the
  plain value it holds, read through its base type: none of the program's methods, its `==` included,
  decides what crosses); this process compares. Anything else fails the test; what it prints is discarded;
- HumanEval: `check(candidate)` runs in a process of its own holding only trusted text (the dataset's
  prompt and test code); `candidate` there is a proxy whose calls go to the program's process over pipes
  and come back as plain values; what the program prints is discarded (HumanEval's harness does so too);
- an early exit, SystemExit, a crash or a timeout is never a pass.

The trusted side is total: whatever bytes the program writes on whatever channel it can reach, `run`
returns a verdict, never an exception. Every channel is read while the program runs under a byte cap
(a channel over its cap is closed and the run fails; a trickle of small writes wakes this process a bounded
number of times). A report is one line per test, each parsed once as it arrives, after its values are counted on
its bytes (at most MAX_REPORT_VALUES a line), and compared at once: this process holds one test's output at a time,
builds no dict from the program's keys (their hashes are the program's to choose; a dict stays a list of pairs,
Pairs) and compares outputs a piece at a time; its CPU on one run's report is measured and capped
(TRUSTED_CPU_SHARE of the run's budget). The CPU budget is decided here, from the CPU time this process measures
(the run's cgroup, wait4), not by a limit the program's process could stretch.

Isolation of the program's process, where the machine allows it (Linux as root; `--check` lists what holds):
- a per-run cgroup (v1 memory / pids / cpuacct / freezer, or v2): memory (tmpfs, memfd and page cache
  included) and tasks (threads included) capped for this run alone, its CPU time measured; everything in it
  killed and the cgroup removed at the end;
- namespaces: network (no network, not even 127.0.0.1), PID (its processes die with its first), IPC,
  UTS (host name "sandbox") and mount, with a new root: a read-only tmpfs holding only the standard
  library (site-packages hidden) and the folders of the shared libraries the interpreter maps, /dev/null, /dev/zero,
  /dev/urandom and a private tmpfs /tmp; nothing else of the host;
- a fresh session keyring; an unprivileged uid of its own (drawn at random from RUN_UIDS: per-user
  counts of the kernel are not shared between runs) with no_new_privs, the parent-death signal re-armed;
  a seccomp filter (libseccomp through ctypes) denying keyrings, ptrace, mount, namespaces, bpf,
  perf_event_open, module / kexec loading, setsid / setpgid, sysinfo and more; new processes (one process
  per run: its CPU time is the run's, threads included); whatever keeps state on an inode every run sees
  (flock, fcntl locks, leases and notifications, inotify, fanotify, futexes without FUTEX_PRIVATE_FLAG,
  page-cache probes), so concurrent runs cannot talk; counts kept for the whole host (asynchronous I/O
  slots, pidfds, mount ids, the inode numbers of new memfds, pipes, sockets and message queues, hugetlb
  pages; sockets also reach past the network namespace in some families, vsock and netlink) and the host's
  disk (statfs, ustat, O_DIRECT; sync and fsync return 0 and do nothing);
- the program's view: the child runs this module's code compiled by the trainer under a neutral name and
  sent on stdin, from the base interpreter (never a virtual environment's path, which stays in its memory),
  its uid and cgroup (open fds, never names) arrive with the job, and sys.argv, orig_argv, executable and
  prefix are neutral: no trainer pid, run counter or checkout path;
- always: limits on CPU time (a backstop past the budget), address space, file size and open files, no
  real-time priority, no core files, a wall-clock timeout that kills the whole process group, an
  environment of only PATH and LANG, captured output capped, and an in-process guard that removes
  fork/exec/kill/system, subprocess and ctypes and keeps writes and deletions in the run's scratch folder
  (an extra layer, not a boundary).
Where a layer is unavailable the first run warns once and names the active ones. The program runs as under
CPython: a real fd 0 under sys.stdin and a file on fd 1 under sys.stdout (fileno(), mode, buffer; whatever
reaches fd 1 counts, read back after the flushes CPython does at exit), stderr on /dev/null (judges ignore it),
exit() and quit(), os._exit ending the input with its output kept, tempfile and /tmp, fileinput on stdin, in a
thread with a large stack (deep recursion works; `signal.signal` raises ValueError there, as in any thread).
The kernel is still shared and the filter is a denylist: for untrusted code at scale, run the trainer in a
container or VM as well. Timing is not closed: the host's page cache of the files every run can read carries
hundreds of bits from one run to a concurrent or later one (bench/sandbox_page_cache.py; docs/code_track.md).
"""
import marshal
import os
import resource
import signal
import sys

OUTCOMES = ("passed", "failed", "runtime_error", "compile_error", "timeout")
NAMESPACES = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]


class Result:
    """One program's outcome (one of OUTCOMES), its tests passed and failed, a detail for people.
    (Plain classes, not dataclasses: every child process imports this file, and starts 12 ms faster.)"""

    def __init__(self, outcome, passed=0, failed=0, detail=""):
        self.outcome, self.passed, self.failed, self.detail = outcome, passed, failed, detail

    def __repr__(self):
        return f"Result(outcome={self.outcome!r}, passed={self.passed}, failed={self.failed}, detail={self.detail!r})"

    def __eq__(self, other):
        return isinstance(other, Result) and vars(self) == vars(other)

    @property
    def reward(self):
        if self.outcome == "compile_error":
            return -1.0
        if self.outcome in ("runtime_error", "timeout"):
            return -0.6
        total = self.passed + self.failed
        return -0.3 + 1.3 * self.passed / total if total else -0.3


# Each run's own uid (when the trainer is root): the kernel keeps per-user counts (tasks, pending signals, message
# queue bytes, pipe pages) that concurrent runs of one uid would share and could signal through. Drawn at random,
# far above the uids of people and of rootless containers, so that the uid tells the program nothing.
RUN_UIDS = range(0x70000000, 0x70000000 + (1 << 24))


def run_uid(limits):
    import random
    return random.SystemRandom().choice(RUN_UIDS) if limits.uid is None else limits.uid


class Limits:
    def __init__(self, timeout=4.0, cpu_seconds=4, memory_mb=1024, output_bytes=1 << 20, processes=64, uid=None,
                 open_files=256):
        self.timeout = timeout              # wall-clock seconds for the whole program and all its tests
        self.cpu_seconds = cpu_seconds      # CPU seconds of each process of the run (threads included), as
                                            # measured by the trusted side; may be fractional
        self.memory_mb = memory_mb          # address space per process, and the memory of the run's cgroup
        self.output_bytes = output_bytes    # per captured stream, and the largest file the program may write
        self.processes = processes          # tasks (threads included) of the run's cgroup, else RLIMIT_NPROC
        self.open_files = open_files        # RLIMIT_NOFILE
        self.uid = uid                      # the unprivileged user programs run as (when this process is root);
                                            # None: each run a uid of its own, drawn at random from RUN_UIDS


# Messages between processes. Trusted -> untrusted (the job, the check's calls): marshal, framed by its
# length (fast, and only ever read by the side that cannot be harmed by it). Untrusted -> trusted (outputs,
# values): one line of JSON, its values counted on its bytes, then read with json.loads (linear in its length
# whatever the bytes, unlike ast.literal_eval, which spends seconds on a megabyte of small literals), tags
# decoded as it parses (parse_report; the check's process, which needs real tuples: parse_line and `decode`).
# The children write it with _json's C string encoder and never import the json package (10 ms each).

def _frame(value):
    data = marshal.dumps(value)
    return len(data).to_bytes(4, "little") + data


def send(stream, value):
    stream.write(_frame(value))
    stream.flush()


def receive(stream):
    size = stream.read(4)
    if len(size) < 4:
        return None
    return marshal.loads(stream.read(int.from_bytes(size, "little")))


# What one report may cost this process: json.loads builds an object per value, so a report holds at most this
# many (an honest megabyte of one-digit numbers is 500,000); counted on its bytes before it is parsed.
MAX_REPORT_VALUES = 600_000


def report_values(line):
    """At most how many values a JSON line (bytes) holds: each one after the first in a container follows a ','
    or ':', each container opens with '[' or '{'; those characters inside strings are not counted. Linear in
    the line, in C; the strings are cut out only when the plain count is over the cap (a megabyte of commas
    printed by an honest program) and there are few enough of them."""
    def separators(text):
        return sum(text.count(c) for c in (b",", b":", b"[", b"{")) + 1
    if separators(line) <= MAX_REPORT_VALUES:                    # an upper bound already: no need to look closer
        return separators(line)
    bare = line.replace(b"\\\\", b"").replace(b'\\"', b"")       # escaped backslashes and quotes
    quotes = bare.count(b'"')
    if quotes > 2 * MAX_REPORT_VALUES:
        return quotes // 2
    return separators(b"".join(bare.split(b'"')[::2]))


class Pairs:
    """A dict the program sent, kept as its list of [key, value] pairs: never hashed on the trusted side (a
    program picks its keys' hashes: 15,000 int keys that are multiples of 2**61 - 1 share one, and rebuilding that
    dict cost the trainer 1.25 s of CPU against 0.04 s for an honest one). `_same_value` looks each key up in the
    expected dict, whose keys are trusted. Equal to nothing by `==` (identity), so no C-level comparison passes it."""
    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs


def _plain_object(pairs):
    """json.loads' object hook: an encoded tuple, non-finite float or dict becomes that value as it is parsed
    (no second walk over the value; a tuple stays a list, as the verdict reads tuples; a dict becomes Pairs); any
    other object is a record, a dict with string keys (hashed with this process's secret SipHash key)."""
    if len(pairs) == 1:
        (tag, value), = pairs
        if tag == "float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag == "int" and type(value) is str:
            return int(value, 16)                            # linear; not hex: ValueError, the report is refused
        if tag == "tuple" and type(value) is list:
            return value
        if tag == "dict" and type(value) is list and all(type(kv) is list and len(kv) == 2 for kv in value):
            return Pairs(value)
    return dict(pairs)


def parse_report(line):
    """One untrusted report line (bytes) -> its record with plain values decoded, or None (not JSON, or not
    plain); ValueError when it holds more than MAX_REPORT_VALUES values (refused before it is parsed)."""
    import json
    if report_values(line) > MAX_REPORT_VALUES:
        raise ValueError(f"a report of more than {MAX_REPORT_VALUES} values")
    try:                                  # as UTF-8 text, as it was counted (json.loads would guess UTF-16 in bytes)
        return json.loads(line.decode("utf-8", "replace"), object_pairs_hook=_plain_object)
    except (ValueError, TypeError, MemoryError, RecursionError):
        return None


def parse_line(line):
    """One untrusted JSON line -> its value, or None when it is not JSON (any text, never an exception)."""
    import json
    try:
        return json.loads(line)
    except (ValueError, TypeError, MemoryError, RecursionError):
        return None


# ---------------------------------------------------------------- plain values across processes

# An int of more bits (past about 4200 decimal digits) crosses in hex, tagged: CPython refuses int <-> decimal str past
# 4300 digits (the conversion is quadratic), on the child's side (repr) and on the trusted side (json.loads), while
# hex is linear and not limited.
LONG_INT_BITS = 14000


class NotPlain(TypeError):
    """A value that is not None, bool, int, float, str, or a list / tuple / dict of them."""


# A subclass of a plain type (collections.Counter, defaultdict, OrderedDict, a named tuple, an IntEnum, a str
# subclass) is sent as the plain value it holds, read through its base type's own C methods: plain Python and
# APPS's harness compare a Counter equal to the expected dict. Its own methods (`==`, items, __iter__, __str__)
# never run. collections' UserDict, UserList and UserString (equal to the dict, list or str they wrap) cross as
# their `data`, encoded in turn. Whatever the program's classes do, what crosses is data, compared by this side.
PLAIN_BASES = ((int, int.__int__), (float, float.__float__), (str, str.__str__),
               (list, lambda x: list(list.__iter__(x))), (tuple, lambda x: tuple(tuple.__iter__(x))),
               (dict, lambda x: dict(dict.items(x))))


def encode(x):
    """A plain value -> JSON, tuples, non-finite floats and ints past LONG_INT_BITS (in hex) tagged. Anything but
    None and the plain types (and their subclasses, as their base type's value) raises NotPlain."""
    kind = type(x)
    if kind not in (type(None), bool, int, float, str, list, tuple, dict):
        base, read = next(((b, r) for b, r in PLAIN_BASES if issubclass(kind, b)), (None, None))   # its real type
        wrappers = sys.modules.get("collections")
        if base is None and wrappers and issubclass(kind, (wrappers.UserDict, wrappers.UserList, wrappers.UserString)):
            return encode(x.data)
        if base is None:
            raise NotPlain(f"a {kind.__name__} is not a plain value")
        kind, x = base, read(x)
    if kind is int and x.bit_length() > LONG_INT_BITS:
        return {"int": hex(x)}
    if x is None or kind in (bool, int, str):
        return x
    if kind is float:
        return x if x == x and abs(x) != float("inf") else {"float": repr(x)}
    if kind is list:
        return [encode(v) for v in x]
    if kind is tuple:
        return {"tuple": [encode(v) for v in x]}
    return {"dict": [[encode(k), encode(v)] for k, v in x.items()]}


def _json_text(x):
    """An encoded plain value (None, bool, int, float, str, list, dict with str keys) as JSON text."""
    import _json
    if x is None:
        return "null"
    if x is True or x is False:
        return "true" if x else "false"
    if type(x) in (int, float):
        return repr(x)                         # finite floats only: encode tags the others
    if type(x) is str:
        return _json.encode_basestring(x)
    if type(x) is list:
        return "[" + ",".join(map(_json_text, x)) + "]"
    return "{" + ",".join(_json.encode_basestring(k) + ":" + _json_text(v) for k, v in x.items()) + "}"


def _line(value):
    """An encoded plain value as one line of JSON (newlines in strings are escaped: always one line)."""
    return _json_text(value) + "\n"


def decode(x):
    """The inverse of `encode`, strict: anything else raises NotPlain."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [decode(v) for v in x]
    if type(x) is dict and len(x) == 1:
        (tag, value), = x.items()
        if tag == "float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag == "int" and type(value) is str:
            try:
                return int(value, 16)
            except ValueError:
                raise NotPlain(f"not an encoded int: {value[:80]}") from None
        if tag == "tuple" and type(value) is list:
            return tuple(decode(v) for v in value)
        if tag == "dict" and type(value) is list and all(type(kv) is list and len(kv) == 2 for kv in value):
            return {decode(k): decode(v) for k, v in value}
    raise NotPlain(f"not an encoded plain value: {str(x)[:80]}")


# splitlines' line boundaries: the output is compared a piece at a time, each cut just after one of them
LINE_BOUNDARY = "[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]"


def _pieces(text, piece=1 << 14):
    """The lines of text.strip().splitlines(), each right-stripped, as lists of about `piece` characters' lines:
    never more than a piece's lines at once (one string of 700,000 lines, split whole, peaked at 54 MiB)."""
    import re
    boundary = re.compile(LINE_BOUNDARY)
    text, start = text.strip(), 0
    while start < len(text):
        cut = boundary.search(text, start + piece)
        end = len(text) if cut is None else cut.end() + text.startswith("\r\n", cut.start())
        yield list(map(str.rstrip, text[start:end].splitlines()))
        start = end


def _same_output(got, expected, piece=1 << 14):
    """Line by line, trailing whitespace ignored; an expected output stored as a list of lines is those lines.
    Streamed a piece at a time, the pieces' lines compared in C, stopping at the first difference: the work is
    bounded by the expected output (trusted), not by what the program printed."""
    if isinstance(expected, list):
        expected = "\n".join(line[:-1] if line.endswith("\n") else line for line in map(str, expected))
    got, expected = str(got), str(expected)
    if got.strip() == expected.strip():                      # the common case, in C
        return True
    a_pieces, b_pieces, a, b = _pieces(got, piece), _pieces(expected, piece), [], []
    while True:
        a, b = a or next(a_pieces, None), b or next(b_pieces, None)
        if a is None or b is None:
            return a is b
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            return False
        a, b = a[n:], b[n:]


def _same_value(got, expected):
    """Equal as values, tuples read as lists. The program's value comes from parse_report: tuples already lists,
    dicts as Pairs. One C-level comparison decides unless the expected value (trusted) holds a tuple or a dict;
    then a walk bounded by the expected value, in which the program's keys are only looked up in dicts built from
    the expected keys."""
    if got == expected or [got] == expected:
        return True
    if not _has_container(expected):
        return False
    return _same(got, expected) or _same([got], expected)


def _has_container(x):
    return type(x) in (tuple, dict) or type(x) is list and any(map(_has_container, x))


def _same(got, expected):
    if type(expected) in (list, tuple):
        return type(got) is list and len(got) == len(expected) and all(map(_same, got, expected))
    if type(expected) is dict:
        if type(got) is not Pairs or len(got.pairs) != len(expected):
            return False
        where = {key: i for i, key in enumerate(expected)}     # trusted keys
        values, seen = list(expected.values()), bytearray(len(expected))
        for key, value in got.pairs:
            try:
                i = where.get(_key(key))
            except TypeError:                                  # a key holding a record (a plain dict)
                return False
            if i is None or seen[i] or not _same(value, values[i]):
                return False
            seen[i] = 1
        return True
    return type(got) not in (list, Pairs) and got == expected


def _key(x):
    """A key the program sent, as the key it was: lists (tuples on its side) as tuples. A Pairs (a dict: no key on
    its side) hashes by identity and so matches no expected key."""
    return tuple(map(_key, x)) if type(x) is list else x


# ---------------------------------------------------------------- the trusted side

_ISOLATION = None
# A child's interpreter runs this module's code, compiled once by the trainer and sent ahead of the job on stdin
# (compiling the file in every child costs 20 ms): no path of the checkout in its arguments, modules or frames.
CHILD = ("import sys, marshal; sandbox = type(sys)('sandbox'); given = sys.stdin.buffer; "
         "exec(marshal.loads(given.read(int.from_bytes(given.read(4), 'little'))), sandbox.__dict__); "
         "del given; sys.exit(sandbox.main(sys.argv[1:]))")
_CHILD_CODE = None
CGROUP_PARENT = "ma_sandbox"           # each run's cgroup: <hierarchy>/ma_sandbox/<trainer pid>_<n>_<its PID ns>
CGROUP_ROOT = "/sys/fs/cgroup"
_RUN_NUMBERS = iter(range(1 << 62))


def _child_code():
    """This module compiled under a neutral file name, framed for the child's stdin (once per trainer)."""
    global _CHILD_CODE
    if _CHILD_CODE is None:
        with open(os.path.abspath(__file__), encoding="utf-8") as f:
            code = marshal.dumps(compile(f.read(), "sandbox.py", "exec"))
        _CHILD_CODE = len(code).to_bytes(4, "little") + code
    return _CHILD_CODE


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _v1_hierarchies():
    """The v1 hierarchies a run's cgroup spans: memory, pids, cpuacct where it exists (the run's CPU time, measured),
    and freezer last (`kill` freezes it)."""
    optional = ["cpuacct"] if os.path.exists(f"{CGROUP_ROOT}/cpuacct/cgroup.procs") else []
    return ["memory", "pids", *optional, "freezer"]


def _cgroup_kind():
    """"v2" (a unified hierarchy with memory and pids), "v1" (memory, pids and freezer hierarchies) or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return None
    try:
        if {"memory", "pids"} <= set(open(f"{CGROUP_ROOT}/cgroup.controllers").read().split()):
            return "v2"
    except OSError:
        pass
    if all(os.path.exists(f"{CGROUP_ROOT}/{c}/cgroup.procs") for c in ("memory", "pids", "freezer")):
        return "v1"
    return None


class _Cgroup:
    """One child's cgroup: memory (page cache, tmpfs and memfd pages included, no swap) and tasks (threads
    included) capped for this run alone. The child joins it before anything else; `kill` freezes it, kills
    every task in it, waits until it is empty and removes it."""

    def __init__(self, kind, limits):
        name = f"{CGROUP_PARENT}/{os.getpid()}_{next(_RUN_NUMBERS)}_{_pid_namespace()}"
        memory, tasks = str(limits.memory_mb << 20), str(limits.processes)
        if kind == "v1":
            self.dirs = [f"{CGROUP_ROOT}/{c}/{name}" for c in _v1_hierarchies()]
            settings = [(self.dirs[0], "memory.limit_in_bytes", memory),
                        (self.dirs[0], "memory.memsw.limit_in_bytes", memory), (self.dirs[1], "pids.max", tasks)]
        else:
            parent = f"{CGROUP_ROOT}/{CGROUP_PARENT}"
            if not os.path.isdir(parent):
                os.makedirs(parent, exist_ok=True)
                _write(f"{parent}/cgroup.subtree_control", "+memory +pids")
            self.dirs = [f"{CGROUP_ROOT}/{name}"]
            settings = [(self.dirs[0], "memory.max", memory), (self.dirs[0], "memory.swap.max", "0"),
                        (self.dirs[0], "pids.max", tasks)]
        self.kind = kind
        try:
            for folder in self.dirs:
                os.makedirs(folder)
            for folder, knob, value in settings:
                try:
                    _write(f"{folder}/{knob}", value)
                except OSError:
                    if "swap" not in knob and "memsw" not in knob:     # no swap accounting: no swap to limit
                        raise
        except BaseException:
            self.kill()
            raise
        self.procs = [f"{folder}/cgroup.procs" for folder in self.dirs]

    def join_fds(self):
        """Its cgroup.procs files opened for writing, for the child to join through (writing "0"): the child never
        holds their paths, which name the trainer's pid and its count of runs (a training clock)."""
        return [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in self.procs]

    def cpu_seconds(self):
        """The CPU time every task of the run has used so far (threads and exited tasks included), or None where no
        hierarchy counts it."""
        try:
            if self.kind == "v2":
                stat = dict(line.split() for line in open(f"{self.dirs[0]}/cpu.stat"))
                return int(stat["usage_usec"]) / 1e6
            for folder in self.dirs:
                if "/cpuacct/" in folder:
                    return int(open(f"{folder}/cpuacct.usage").read()) / 1e9
        except (OSError, ValueError, KeyError):
            pass
        return None

    def _tasks(self):
        tasks = set()
        for folder in self.dirs:
            try:
                tasks.update(int(pid) for pid in open(f"{folder}/cgroup.procs").read().split())
            except OSError:
                pass
        return sorted(tasks)

    def kill(self):
        import time
        folder = self.dirs[-1] if self.kind == "v1" else self.dirs[0]
        if os.path.isdir(folder) and self._tasks():
            if self.kind == "v2" and os.path.exists(f"{folder}/cgroup.kill"):
                _write(f"{folder}/cgroup.kill", "1")
            else:                                                     # frozen: nothing forks while it is killed
                freeze, frozen, thawed = (("freezer.state", "FROZEN", "THAWED") if self.kind == "v1"
                                          else ("cgroup.freeze", "1", "0"))
                _write(f"{folder}/{freeze}", frozen)
                for pid in self._tasks():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _write(f"{folder}/{freeze}", thawed)
        end = time.monotonic() + 10
        for folder in reversed(self.dirs):
            while os.path.isdir(folder):
                try:
                    os.rmdir(folder)
                except FileNotFoundError:
                    break
                except OSError:                                          # tasks still exiting
                    if time.monotonic() > end:
                        raise
                    for pid in self._tasks():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.002)


def _pid_namespace():
    """This process's PID namespace (its inode): trainer pids are only comparable within one."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _remove_stale_cgroups(kind):
    """Cgroups of trainers that are gone (killed mid-run): everything in them killed, the folders removed."""
    parents = ([f"{CGROUP_ROOT}/{c}/{CGROUP_PARENT}" for c in _v1_hierarchies()] if kind == "v1"
               else [f"{CGROUP_ROOT}/{CGROUP_PARENT}"])
    stale = set()
    for parent in parents:
        for name in os.listdir(parent) if os.path.isdir(parent) else []:
            owner, _, namespace = name.partition("_")[0], None, name.rpartition("_")[2]
            if owner.isdigit() and namespace == _pid_namespace() and not os.path.exists(f"/proc/{owner}"):
                stale.add(name)                      # a trainer of this PID namespace, and it is gone
    for name in stale:
        group = _Cgroup.__new__(_Cgroup)
        group.kind = kind
        group.dirs = [f"{parent}/{name}" for parent in parents]
        try:
            group.kill()
        except OSError:
            pass


def isolation():
    """(unshare command prefix or [], drop to an unprivileged uid?, cgroup kind or None, seccomp?, the layers
    that hold), probed once."""
    global _ISOLATION
    if _ISOLATION is None:
        import shutil
        import subprocess
        root = os.geteuid() == 0
        prefix, drop, kind, seccomp = [], False, None, False
        unshare = shutil.which("unshare")
        # the real start of a child (cgroup, mounts, then the uid), tried from the most isolated setting down
        kinds = [_cgroup_kind(), None] if _cgroup_kind() else [None]
        if kinds[0]:
            _remove_stale_cgroups(kinds[0])
        candidates = ([(NAMESPACES, True), (NAMESPACES, False)] if root else []) + [
            (["--user", "--map-root-user", *NAMESPACES], False)]
        linux = sys.platform.startswith("linux")
        for (flags, with_uid), cg_kind in [(c, k) for c in (candidates if unshare and linux else []) for k in kinds]:
            group, joins = None, []
            try:
                group = _Cgroup(cg_kind, Limits()) if cg_kind else None
                joins = group.join_fds() if group else []
                probe = [unshare, *flags, _interpreter(), "-I", "-S", "-c", CHILD, "--probe", "ns"]
                given = _child_code() + _frame({"uid": run_uid(Limits()) if with_uid else -1, "cgroup": joins})
                out = subprocess.run(probe, input=given, capture_output=True, timeout=20, cwd="/",
                                     pass_fds=joins).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                out = []
            finally:
                for fd in joins:
                    os.close(fd)
                if group:
                    group.kill()
            if out[:1] == [b"isolated"]:
                prefix, drop, kind, seccomp = [unshare, *flags], with_uid, cg_kind, b"seccomp" in out
                break
        if not prefix:
            kind = _cgroup_kind()
            seccomp = linux and _libseccomp() is not None
        layers = ([f"per-run cgroup ({kind}): memory (tmpfs, memfd and page cache included) and tasks (threads "
                   "included) capped per run; everything the run started is killed and the cgroup removed"]
                  if kind else [])
        layers += (["network namespace: no network, not even 127.0.0.1",
                    "mount namespace with an allowlisted root: the interpreter and its standard library read-only, "
                    "/dev/null, /dev/zero, /dev/urandom and a private tmpfs /tmp; nothing else of the host",
                    "PID namespace: no other process in /proc; its processes die with its first",
                    "IPC namespace; UTS namespace with a neutral host name; a fresh session keyring"] if prefix else [])
        layers += (["an unprivileged uid of its own per run (drawn at random: no per-user count shared between "
                    "runs), no_new_privs and the parent-death signal re-armed"] if drop else [])
        layers += (["seccomp filter: keyrings, ptrace, mount, namespaces, bpf, perf_event_open, module and kexec "
                    "loading, setsid / setpgid, sysinfo and more denied",
                    "one process per run (seccomp: fork, vfork and clone without CLONE_THREAD denied): the run's CPU "
                    "time is one process's, threads included",
                    "nothing lockable or watchable shared between concurrent runs (seccomp: flock, fcntl record locks, "
                    "leases and notifications, inotify, fanotify, shared futexes, page-cache probes (mincore, fadvise, "
                    "readahead, cachestat, page-out, RWF_NOWAIT) denied)",
                    "no host-wide count a run can raise or read (seccomp: asynchronous I/O slots, pidfds, mount ids, "
                    "new memfds, pipes, sockets and message queues (their inode numbers), hugetlb pages denied; "
                    "syscalls newer than the filter answer ENOSYS)",
                    "the host's disk out of reach (seccomp: sync, syncfs, fsync, fdatasync, sync_file_range and msync "
                    "return 0 and do nothing; statfs, ustat and O_DIRECT denied)"]
                   if seccomp else [])
        counts_cpu = kind == "v2" or kind == "v1" and "cpuacct" in _v1_hierarchies()
        measured = "the run's cgroup while it runs, wait4 at its end" if counts_cpu else "wait4 at its end"
        layers += ["rlimits: CPU time (a backstop a second past the budget, soft limit = hard), address space, file "
                   "size, open files, no real-time priority, no core files" +
                   ("" if kind else ", processes (per uid: not for root)"),
                   f"CPU budget decided by the trusted side from the CPU time it measures ({measured})",
                   "wall-clock timeout; the whole process group is killed",
                   "trusted side reads every channel while the program runs, each capped, and always ends in a "
                   f"verdict; a trickle of bytes wakes it at most {FREE_SMALL_READS} times, then once per "
                   f"{READ_PACE} s",
                   f"one report costs the trusted side at most {MAX_REPORT_VALUES} values a line, counted before it "
                   "is parsed (a line per test, judged as it arrives: one test's output held at a time); no dict "
                   "built from the program's keys; its CPU on a run's report at most "
                   f"{TRUSTED_CPU_SHARE:g} of the run's budget",
                   "the program's view: no trainer pid, run counter or checkout path in its arguments, interpreter "
                   "paths (it runs from the base installation, never a virtual environment), memory (its cgroup is "
                   "joined through fds, not names), modules or frames; environment scrubbed to PATH and LANG; output "
                   "capped",
                   "in-process guard: fork/exec/kill/system, subprocess, ctypes removed; writes and deletions only in "
                   "the run's scratch folder"]
        _ISOLATION = (prefix, drop, kind, seccomp, layers)
        missing = [name for name, held in [("namespaces", prefix), ("an unprivileged uid", drop),
                                          ("per-run cgroups", kind), ("seccomp", seccomp)] if not held]
        if missing:
            print("[sandbox] warning: no " + ", no ".join(missing) + " on this machine (namespaces need Linux with "
                  "unshare, as root or with unprivileged user namespaces; cgroups need root; seccomp needs "
                  "libseccomp.so.2); active layers: " + "; ".join(layers), file=sys.stderr)
    return _ISOLATION


def _interpreter():
    """The interpreter a child runs: the one a virtual environment stands for. A child's executable path stays in
    its memory (AT_EXECFN, Py_GetProgramFullPath; a venv's pyvenv.cfg sets Py_GetPrefix), and a venv's lies in a
    checkout. The children run with -I -S, without site-packages: the venv would add nothing to them."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base) if os.path.isfile(base) else sys.executable


def _spawn(role, job, fds, limits):
    """Start `sandbox.py <role>` in its own session (cgroup and namespaces), send it `job` on stdin; returns
    (process, its cgroup or None, its folder or None)."""
    import subprocess
    import tempfile
    prefix, drop, kind, _, _ = isolation()
    group = folder = None
    joins = []
    try:
        group = _Cgroup(kind, limits) if kind else None
        joins = group.join_fds() if group else []
        folder = None if prefix else tempfile.mkdtemp(prefix=f"sandbox_{os.getpid()}_")   # whose it is, for leak checks
        argv = [_interpreter(), "-I", "-S", "-c", CHILD, role, "ns" if prefix else "plain", *map(str, fds)]
        # no preexec_fn (unsafe with run_many's threads): the child joins its cgroup and sets its limits first
        proc = subprocess.Popen(prefix + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=folder or "/", pass_fds=[*fds, *joins], start_new_session=True,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    except BaseException:
        _end([(None, group, folder)])
        raise
    finally:
        for fd in joins:
            os.close(fd)
    try:
        setup = {"uid": run_uid(limits) if drop else -1, "cgroup": joins}   # not in its argv; fds, not paths
        proc.stdin.write(_child_code() + _frame({**job, "limits": vars(limits), "setup": setup}))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return proc, group, folder


CPU_CHECK = 0.05         # how often (s) the trusted side reads the CPU time of a run's cgroup while it runs

# What reading the channels may cost the trusted side. A wakeup that brings fewer than SMALL_READ bytes is small;
# past FREE_SMALL_READS of them, the trusted side waits READ_PACE s before it looks again. A program writing one byte
# at a time, each once the last was read, woke the trainer for each (28,000-64,000 reads, 0.2-0.45 s of its CPU in
# 3 s; docs/code_track.md); now at most FREE_SMALL_READS + timeout / READ_PACE wakeups, and large writes are bounded
# by the channels' byte caps. An honest run (its report at the end, one or a few large reads) never waits.
SMALL_READ, FREE_SMALL_READS, READ_PACE = 4096, 64, 0.01


def _read(fd):
    return os.read(fd, 1 << 16)


def _collect(caps, closers, deadline, over_budget=None, lines=None):
    """Read every channel ({fd: byte cap}) while the children run, until each ends, the deadline, or over_budget()
    (checked every CPU_CHECK s), paced (above). A channel in `lines` ({fd: consumer}) is handed each complete line
    as it arrives and keeps only the line in progress, its cap a cap per line; a consumer returning False wants no
    more (its channel is closed). A channel over its cap is closed at once (closers[fd]; its writer gets EPIPE).
    Returns ({fd: bytes}, in time and budget?, the fds over their cap)."""
    lines = lines or {}
    import selectors
    import time
    data, over, small = {fd: bytearray() for fd in caps}, set(), 0
    checked = time.monotonic()
    with selectors.DefaultSelector() as selector:
        for fd in caps:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return data, False, over
            if over_budget and time.monotonic() - checked >= CPU_CHECK:
                if over_budget():
                    return data, False, over
                checked = time.monotonic()
            ready = selector.select(min(remaining, CPU_CHECK) if over_budget else remaining)
            if not ready:                                    # a budget check's timeout: not a wakeup to pace
                continue
            brought = 0
            for key, _ in ready:
                try:
                    chunk = _read(key.fd)
                except BlockingIOError:
                    continue
                brought += len(chunk)
                wanted = True
                if chunk and key.fd in lines:
                    wanted = _hand_over(data[key.fd], chunk, lines[key.fd])
                    if wanted and len(data[key.fd]) <= caps[key.fd]:
                        continue
                elif chunk and len(data[key.fd]) + len(chunk) <= caps[key.fd]:
                    data[key.fd] += chunk
                    continue
                selector.unregister(key.fd)
                if chunk:
                    if wanted:
                        over.add(key.fd)
                    closers[key.fd]()
            small += brought < SMALL_READ
            if small > FREE_SMALL_READS:
                time.sleep(max(0.0, min(READ_PACE, deadline - time.monotonic())))
    return data, True, over


def _hand_over(line, chunk, consumer):
    """Append `chunk` to the line in progress and hand every complete line to `consumer`, which says whether it
    wants more; returns that. Each byte is searched once."""
    start, search = 0, len(line)
    line += chunk
    wanted = True
    while wanted and (end := line.find(b"\n", search)) >= 0:
        wanted = consumer(bytes(line[start:end]))
        start = search = end + 1
    del line[:start]
    return wanted


def _reap(proc, deadline, over_budget=None):
    """Wait for a child until the deadline or over_budget() (polling, as Popen.wait does with a timeout), through
    wait4: returns the CPU seconds it and the processes it reaped used (the child of `unshare` included), or None
    if it still runs."""
    import time
    delay = 0.0005
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        remaining = deadline - time.monotonic()
        if remaining <= 0 or over_budget and over_budget():
            return None
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, CPU_CHECK)


def _end(started):
    """Kill everything each child started (its cgroup, then its process group), reap, remove its folder.
    Every child is cleaned up even when another's cleanup fails; the first failure is raised afterwards."""
    import shutil
    failure = None
    for proc, group, folder in started:
        try:
            if group:
                group.kill()
        except Exception as err:  # noqa: BLE001 - the others are still cleaned up
            failure = failure or err
        finally:
            if proc:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                for stream in (proc.stdout, proc.stderr):
                    stream.close()
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    if failure:
        raise failure


def run(program, tests, limits=None):
    """Run one program against its tests; never raises. A failure of the sandbox itself (a cgroup that
    cannot be made or killed, a process that cannot start) fails the run too, and is printed to stderr."""
    try:
        return _run(program, tests, limits)
    except Exception as err:  # noqa: BLE001 - one sample must not end a training batch
        print(f"[sandbox] warning: the sandbox failed on this run ({_error(err)}); scored as a runtime error",
              file=sys.stderr)
        return Result("runtime_error", detail=f"sandbox failure: {_error(err)}")


def _run(program, tests, limits):
    import time
    limits = limits or Limits()
    humaneval = "entry_point" in tests
    judge = _Judge(tests, limits)
    result_r, result_w = os.pipe()                           # the program's process -> this one
    if humaneval:                 # the check's process: calls to the program's process, replies, its verdict
        (calls_r, calls_w), (replies_r, replies_w), (check_r, check_w) = os.pipe(), os.pipe(), os.pipe()
        jobs = [("--serve", {"program": program, "entry_point": tests["entry_point"]}, (result_w, calls_r, replies_w)),
                ("--check-child", {"prompt": tests.get("prompt", ""), "test": tests["test"],
                                   "entry_point": tests["entry_point"]}, (check_w, calls_w, replies_r))]
        reads = {result_r: judge.program_line, check_r: judge.check_line}
    else:
        jobs = [("--run", {"program": program, "inputs": tests["inputs"], "fn_name": tests.get("fn_name")},
                 (result_w,))]
        reads = {result_r: judge.program_line}
    started, closed = [], set()
    deadline = time.monotonic() + limits.timeout
    try:
        try:
            for role, payload, fds in jobs:
                started.append(_spawn(role, payload, fds, limits))
        finally:
            for _, _, fds in jobs:                          # the children hold their ends
                for fd in fds:
                    os.close(fd)
        caps = {fd: report_bytes(limits) for fd in reads}  # per line
        closers = {fd: lambda fd=fd: (closed.add(fd), os.close(fd)) for fd in reads}
        for proc, _, _ in started:                          # what the children print: kept up to output_bytes
            for stream in (proc.stdout, proc.stderr):
                caps[stream.fileno()], closers[stream.fileno()] = limits.output_bytes, stream.close
        stderr_fd = started[0][0].stderr.fileno()
        groups = [group for _, group, _ in started if group]

        def spent():                          # a child's cgroup has used the CPU budget
            return any((group.cpu_seconds() or 0.0) >= limits.cpu_seconds for group in groups)
        over_budget = spent if groups else None
        data, in_time, over = _collect(caps, closers, deadline, over_budget, reads)
        cpu = 0.0                             # the most CPU time one child used, measured here: no limit the
        for proc, group, _ in started:        # child can touch decides its budget
            reaped = _reap(proc, deadline if in_time else 0, over_budget)   # else killed in _end
            in_time = in_time and reaped is not None
            measured = [m for m in (reaped, group.cpu_seconds() if group else None) if m is not None]
            cpu = max([cpu, *measured])
        code = started[0][0].returncode
        stderr = bytes(data[stderr_fd][:4000]).decode(errors="replace")
    finally:
        try:
            _end(started)
        finally:
            for fd in set(reads) - closed:
                os.close(fd)
    try:                                      # whatever bytes came back, a verdict and never an exception
        return _decide(judge, bool(over & set(reads)), in_time and cpu < limits.cpu_seconds, code, stderr, limits)
    except Exception as err:  # noqa: BLE001
        return Result("runtime_error", detail=f"unreadable report: {_error(err)}")


def report_bytes(limits):
    """The cap on one line of a report channel: one test's output, JSON-escaped (at most 6 bytes a character)."""
    return 6 * limits.output_bytes + (1 << 16)


# The trusted side's CPU on one run's report lines (parsing, comparing), measured on this thread and capped at this
# share of the run's CPU budget: past it, the run fails. Each line is bounded (report_bytes, MAX_REPORT_VALUES) and
# the lines are at most the tests, so the cap is passed by at most one line's work.
TRUSTED_CPU_SHARE = 0.25


class _Judge:
    """Reads a run's report lines as they arrive, one line per test (parse_report), compares each output with
    the expected one at once and keeps only the counts: the trusted side holds one test's output at a time,
    whatever the run's number of tests. Stops (wants no more lines) once a verdict is decided."""

    def __init__(self, tests, limits):
        self.tests, self.cap = tests, TRUSTED_CPU_SHARE * limits.cpu_seconds
        self.cpu, self.lines, self.passed, self.failed = 0.0, 0, 0, 0
        self.result = self.check = None                     # a decided Result; the HumanEval check's record

    def _timed(self, read, line):
        import time
        start = time.thread_time()
        try:
            read(line)
        except (ValueError, TypeError, RecursionError, MemoryError) as err:
            self.result = Result("runtime_error", self.passed, self.failed, f"unreadable report: {_error(err)}")
        self.cpu += time.thread_time() - start
        if self.result is None and self.cpu > self.cap:
            self.result = Result("runtime_error", self.passed, self.failed, "the report cost the trusted side over "
                                 f"{self.cap:g} s of CPU ({TRUSTED_CPU_SHARE:g} of the run's budget)")
        return self.result is None

    def program_line(self, line):
        return self._timed(self._program_line, line)

    def check_line(self, line):
        return self._timed(self._check_line, line)

    def _program_line(self, line):
        record, i = parse_report(line), self.lines
        self.lines += 1
        if not isinstance(record, dict):
            self.result = Result("runtime_error", self.passed, self.failed, "an unreadable report line")
        elif "compile_error" in record and i == 0:
            self.result = Result("compile_error", detail=str(record["compile_error"])[:2000])
        elif "entry_point" in self.tests:                   # the program's process reports only a compile error
            self.result = Result("runtime_error", detail="a report line that is not a compile error")
        elif i >= len(self.tests["outputs"]):
            self.result = Result("runtime_error", self.passed, self.failed, "more report lines than tests")
        elif "error" in record or "out" not in record:
            self.result = Result("runtime_error", self.passed, self.failed, str(record.get("error", ""))[:2000])
        else:
            expected = self.tests["outputs"][i]
            same = _same_value if "fn_name" in self.tests else _same_output
            ok = same(record["out"], expected)
            self.passed, self.failed = self.passed + ok, self.failed + (not ok)

    def _check_line(self, line):
        if self.check is not None:
            self.result = Result("runtime_error", detail="more than one verdict line from the check")
        self.check = parse_report(line)


def _decide(judge, over, in_time, code, stderr, limits):
    if judge.result is not None and judge.result.outcome == "compile_error":
        return judge.result
    if not in_time:                           # the wall clock, or the CPU the trusted side measured
        return Result("timeout", detail=f"killed after {limits.timeout} s (wall clock) or {limits.cpu_seconds} s (CPU)")
    if over:
        return Result("runtime_error",
                      detail=f"output limit exceeded (a report line over {report_bytes(limits)} bytes)")
    if judge.result is not None:
        return judge.result
    if "entry_point" in judge.tests:
        return _check_verdict(judge.check if isinstance(judge.check, dict) else None)
    if judge.lines < len(judge.tests["outputs"]):
        died = f"the program died (exit {code}): {stderr[-500:]}"
        return Result("runtime_error", judge.passed, judge.failed, died)
    return Result("passed" if judge.failed == 0 else "failed", judge.passed, judge.failed)


def _check_verdict(check):
    if not check:
        return Result("runtime_error", detail="the check ended without a verdict")
    if check.get("ok") is True:
        return Result("passed", 1, 0)
    if check.get("assertion"):
        return Result("failed", 0, 1, str(check.get("detail", "")))
    return Result("runtime_error", detail=str(check.get("detail", ""))[-500:])


def execution_reward(problems, responses, limits=None):
    """The code track's reward: each problem row's `prefix` + response run against its `tests`,
    concurrently. Returns (the paper's execution reward per response, 1.0 where every test passed)."""
    results = run_many([(row["prefix"] + text, row["tests"]) for row, text in zip(problems, responses)], limits)
    return [r.reward for r in results], [float(r.outcome == "passed") for r in results]


def run_many(jobs, limits=None, workers=None):
    """[(program, tests)] -> [Result], at most one program per CPU core at a time."""
    from concurrent.futures import ThreadPoolExecutor
    isolation()                                             # probe (and warn) once, before the threads
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run(job[0], job[1], limits), jobs))


# ---------------------------------------------------------------- inside the children

def _libc():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return ctypes, libc


def _mounted_library_dirs():
    """The folders of every shared library this process has mapped (the dynamic loader, libc, libpython,
    libffi, ...): what extension modules of the standard library need, and nothing else of the system."""
    folders = set()
    for line in open("/proc/self/maps"):
        path = line.split(maxsplit=5)[-1].strip() if line.count(" ") >= 5 else ""
        if path.startswith("/") and ".so" in path:
            folders.add(os.path.dirname(os.path.realpath(path)))
    return folders


def _join(cgroup_fds):
    """Join the run's cgroup through its cgroup.procs files, opened by the trainer ("0": this process)."""
    for fd in cgroup_fds:
        os.write(fd, b"0")
        os.close(fd)


def _isolate(uid, cgroup_fds, tmp_mb=64):
    """In the new namespaces, still root there: join the run's cgroup, a fresh session keyring, then a new
    root: a tmpfs holding only the standard library and the shared libraries read-only, /dev/null, /dev/zero,
    /dev/urandom and a private tmpfs /tmp with the working folder; then (as root on the host) the
    unprivileged uid with no_new_privs and the parent-death signal re-armed."""
    ctypes, libc = _libc()
    _join(cgroup_fds)                                        # before anything else: all it starts is in it

    def mount(source, target, fstype, flags, options=None):
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      options and options.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {target}")
    rdonly, nosuid, nodev, remount, bind, recursive = 1, 2, 4, 32, 4096, 16384
    if libc.syscall(250, 1, None) < 0:                       # keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)
        raise OSError(ctypes.get_errno(), "a fresh session keyring")
    for call, name in ((libc.sethostname, b"sandbox"), (libc.setdomainname, b"(none)")):   # its own UTS namespace
        if call(name, len(name)) != 0:
            raise OSError(ctypes.get_errno(), "a neutral host name")
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    visible = sorted({stdlib, *_mounted_library_dirs()})
    hidden = [os.path.join(stdlib, name) for name in ("site-packages", "dist-packages")]
    root = "/tmp"                                            # any folder: a tmpfs over it becomes the new root
    mount("tmpfs", root, "tmpfs", nosuid | nodev, "size=1m,mode=755")

    def show(path, flags):
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        mount(path, target, None, bind | recursive)
        mount(None, target, None, remount | bind | rdonly | flags)
    for path in visible:
        if not any(path == other or path.startswith(other + os.sep) for other in visible if other != path):
            show(path, nosuid | nodev)
    for path in hidden:
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", rdonly | nosuid | nodev, "size=4k")
    for device in ("/dev/null", "/dev/zero", "/dev/urandom"):
        show(device, nosuid)
    for link in ("/lib", "/lib64", "/bin"):                  # merged-/usr symlinks, as on the host
        if os.path.islink(link):
            os.symlink(os.readlink(link), root + link)
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", nosuid | nodev, f"size={tmp_mb}m,mode=1777")   # the inputs are here too
    os.mkdir(root + "/tmp/work", 0o700)
    os.chdir(root)
    if libc.syscall(155, b".", b".") != 0:                   # pivot_root(".", "."): the old root on top
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", 2) != 0:                           # MNT_DETACH: and gone
        raise OSError(ctypes.get_errno(), "umount the old root")
    os.chdir("/")
    mount(None, "/", None, remount | rdonly | nosuid | nodev)
    if uid >= 0:
        os.chown("/tmp/work", uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:      # PR_SET_PDEATHSIG, cleared by the uid change
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    os.chdir("/tmp/work")


# syscalls a test program never needs; keyrings first (state shared across runs and with the trainer)
DENIED_SYSCALLS = ("add_key", "request_key", "keyctl", "ptrace", "mount", "umount2", "pivot_root", "chroot", "bpf",
                   "perf_event_open", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module",
                   "finit_module", "delete_module", "reboot", "swapon", "swapoff", "process_vm_readv",
                   "process_vm_writev", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "fsopen", "fsmount",
                   "fspick", "fsconfig", "move_mount", "open_tree", "mount_setattr", "acct", "quotactl", "syslog",
                   "iopl", "ioperm", "personality", "setsid", "setpgid", "lookup_dcookie", "vhangup", "settimeofday",
                   "clock_settime", "adjtimex", "sethostname", "setdomainname", "io_uring_setup",
                   # one process per run: its CPU time limit is the run's (threads count in it, forks would not)
                   "fork", "vfork",
                   # state kept on inodes that every run sees (the standard library, /dev/null): concurrent runs
                   # would talk through locks, watches, shared futexes and the page cache
                   "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
                   "futex_waitv", "futex_wake", "futex_wait", "futex_requeue", "mincore", "fadvise64", "readahead",
                   "cachestat", "remap_file_pages",
                   # the host's memory, load, uptime and process count
                   "sysinfo",
                   # counts the kernel keeps for the whole host, scoped by no namespace or uid: a run would raise
                   # them in proportion to a secret for a concurrent run to read, or use them up for the trainer.
                   # Asynchronous-I/O slots (aio-nr), process ids (a pidfd's inode number counts the processes the
                   # host has started: a training clock), mount ids, the host's disk (statfs, ustat: its size and
                   # free space fall as checkpoints are written), NTP state, secret memory, another process's memory
                   "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
                   "io_uring_enter", "io_uring_register", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
                   "statfs", "fstatfs", "ustat", "quotactl_fd", "clock_adjtime", "memfd_secret", "kcmp",
                   "process_madvise", "process_mrelease",
                   # a memfd's inode number comes from one counter of the host's, which every memfd, shared
                   # mapping and SysV segment of the host moves (the run's own files are in its /tmp instead)
                   "memfd_create",
                   # so do a pipe's, a socket's and a message queue's, from another: every pipe and socket the host
                   # makes moves it (a run made them to signal a concurrent run, which read it from its own). No
                   # test program needs them (a FIFO in /tmp is a pipe with the run's own inode number); besides,
                   # a socket reaches past the network namespace in some families (vsock: a virtual machine's
                   # host; netlink: the host's device events, socket cookies) and reads host-wide counters
                   # through its options (SO_COOKIE, SO_NETNS_COOKIE: one network namespace per run)
                   "pipe", "pipe2", "socket", "socketpair", "mq_open")
# Calls that would make the host's disk work for a run (sync() wrote back the host's dirty pages: a test's 8 MiB).
# Everything a run may write is in memory (its tmpfs /tmp, memfds), where they do nothing: they return 0 untouched.
PRETENDED_SYSCALLS = ("sync", "syncfs", "fsync", "fdatasync", "sync_file_range", "msync")
# Syscalls newer than libseccomp 2.5 (it cannot name them): numbers from 424 on are the same on every architecture
# but alpha and mips. statmount / listmount read mount ids (the unique one counts every mount the host has made:
# each run makes a dozen, a training clock); the LSM calls read the host's security modules. Anything newer than
# this list answers ENOSYS (libc falls back, as on an older kernel): a new kernel does not widen the filter.
NEWER_DENIED = {457: "statmount", 458: "listmount", 459: "lsm_get_self_attr", 460: "lsm_set_self_attr",
                461: "lsm_list_modules", 467: "open_tree_attr"}
NEWER_UNKNOWN = range(470, 520)
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
CLONE_THREAD, CLONE_PIDFD, FUTEX_PRIVATE_FLAG = 0x00010000, 0x00001000, 128
# fcntl's record locks (POSIX and open-file-description), leases and directory notifications
FCNTL_SHARED_STATE = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
MADV_COLD, MADV_PAGEOUT = 20, 21                             # evict pages of a file every run maps
RWF_NOWAIT = 8                                               # preadv2 that fails unless the page is cached
STATX_MNT_IDS = (0x1000, 0x4000)                             # statx's mount id and unique mount id (see NEWER_DENIED)
# the hugetlb page pool is the host's: mmap MAP_HUGETLB, shmget SHM_HUGETLB (memfd_create is denied)
MAP_HUGETLB, SHM_HUGETLB = 0x40000, 0o4000
F_SETFL = 4                                                  # O_DIRECT (open, openat, fcntl): reads from the host's
                                                             # disk past its cache, a lever on its I/O and a probe


def _libseccomp():
    import ctypes
    try:
        return ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None


def _seccomp():
    """Deny DENIED_SYSCALLS and NEWER_DENIED; clone() with a namespace flag, CLONE_PIDFD or without CLONE_THREAD (a
    thread, never a new process); clone3 and openat2 (ENOSYS: libc falls back to clone and openat, whose arguments
    the filter can read), and syscalls newer than it knows; fcntl's locks, leases and notifications; futexes without
    FUTEX_PRIVATE_FLAG (keyed by inode and offset on a file's pages: the standard library's pages are every run's);
    madvise's page-out and preadv2's RWF_NOWAIT (page-cache probes); statx's mount ids; hugetlb pages; O_DIRECT.
    PRETENDED_SYSCALLS return 0 and do nothing. True where the filter is loaded (needs libseccomp.so.2 and
    no_new_privs or root)."""
    import ctypes
    lib = _libseccomp()
    if lib is None:
        return False
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]

    class Compare(ctypes.Structure):                         # struct scmp_arg_cmp
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    allow, eperm, enosys, pretend = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x00050000
    masked_eq, eq = 7, 4
    ctx = lib.seccomp_init(allow)
    if not ctx:
        return False

    def number(name):
        return lib.seccomp_syscall_resolve_name(name.encode())

    def add(action, syscall, *compares):                     # compares: (arg, op, a, b), all must hold
        if syscall < 0:                                      # unknown to libseccomp and to this kernel's table
            return True
        array = (Compare * len(compares))(*(Compare(*c) for c in compares)) if compares else None
        return lib.seccomp_rule_add_array(ctx, action, syscall, len(compares), array) == 0

    clone, fcntl = number("clone"), number("fcntl")
    rules = [(eperm, number(name)) for name in DENIED_SYSCALLS] + [(eperm, n) for n in NEWER_DENIED]
    rules += [(enosys, number("clone3")), (enosys, number("openat2"))] + [(enosys, n) for n in NEWER_UNKNOWN]
    rules += [(pretend, number(name)) for name in PRETENDED_SYSCALLS]
    rules += [(eperm, clone, (0, masked_eq, flag, flag)) for flag in NAMESPACE_FLAGS + (CLONE_PIDFD,)]
    rules += [(eperm, clone, (0, masked_eq, CLONE_THREAD, 0)),
              (eperm, number("futex"), (1, masked_eq, FUTEX_PRIVATE_FLAG, 0))]
    rules += [(eperm, fcntl, (1, eq, cmd, 0)) for cmd in FCNTL_SHARED_STATE]
    rules += [(eperm, number("madvise"), (2, eq, advice, 0)) for advice in (MADV_COLD, MADV_PAGEOUT)]
    rules += [(eperm, number("preadv2"), (5, masked_eq, RWF_NOWAIT, RWF_NOWAIT))]
    rules += [(eperm, number("statx"), (3, masked_eq, bit, bit)) for bit in STATX_MNT_IDS]
    rules += [(eperm, number("mmap"), (3, masked_eq, MAP_HUGETLB, MAP_HUGETLB)),
              (eperm, number("shmget"), (2, masked_eq, SHM_HUGETLB, SHM_HUGETLB))]
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        rules += [(eperm, number("open"), (1, masked_eq, direct, direct)),
                  (eperm, number("openat"), (2, masked_eq, direct, direct)),
                  (eperm, fcntl, (1, eq, F_SETFL, 0), (2, masked_eq, direct, direct))]
    if not all(add(action, syscall, *compares) for action, syscall, *compares in rules):
        return False
    return lib.seccomp_load(ctx) == 0


def _set_limits(limits, rlimit_nproc=True, open_already=0):
    # The CPU budget is decided on the trusted side, from the CPU time it measures (the run's cgroup, wait4). The
    # kernel's limit is a backstop a second past it, its soft limit equal to its hard one: a process may raise a soft
    # limit to its hard one and ignore SIGXCPU, never pass the hard one (SIGKILL).
    cpu = max(1, -int(-limits["cpu_seconds"] // 1)) + 1
    memory, size, nproc = limits["memory_mb"] << 20, limits["output_bytes"], limits["processes"]
    files = limits.get("open_files", 256) + open_already          # the inputs' files do not count
    for name, value in [(resource.RLIMIT_CPU, (cpu, cpu)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (size, size)), (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_RTPRIO, (0, 0)),          # no real-time priority above the trainer's
                        (resource.RLIMIT_NOFILE, (files, files))] + (
                       [(resource.RLIMIT_NPROC, (nproc, nproc))] if rlimit_nproc else []):
        try:
            resource.setrlimit(name, value)
        except (ValueError, OSError):
            pass


class ProgramExit(BaseException):
    """os._exit(code) in the program: ends this input as sys.exit(code) would, but no `except SystemExit` or
    `except Exception` of the program stops it (its output so far is kept: a real _exit would lose it here)."""


def _program_exit(code):
    raise ProgramExit(code)


def _guard(scratch, memory_mb=1024, isolated=False):
    """Remove the process and signal calls generated code never needs, and confine writes and deletions to
    the scratch folder (an extra layer: in the mount namespace the kernel refuses every write outside /tmp)."""
    import _sitebuiltins
    import builtins
    import io
    import posix
    import shutil as shutil_
    import subprocess as subprocess_
    os.environ.clear()                                  # before unsetenv goes
    for module in (os, posix):
        for name in ("fork", "forkpty", "vfork", "kill", "abort", "killpg", "system", "popen", "execv", "execve",
                     "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
                     "spawnvpe", "spawnl", "spawnle", "posix_spawn", "posix_spawnp", "chown", "lchown", "fchown",
                     "setuid", "setgid", "setsid", "setpgrp", "setpgid", "putenv", "unsetenv", "register_at_fork",
                     "symlink", "link"):
            if hasattr(module, name):          # deleted, not set to None: code that asks hasattr()
                delattr(module, name)           # (random's register_at_fork) carries on without it
        module._exit = _program_exit
    for module, names in [(signal, ("pthread_kill", "pthread_sigmask")),
                          (subprocess_, ("Popen", "run", "call", "check_call", "check_output", "getoutput"))]:
        for name in names:
            delattr(module, name)
    builtins.exit, builtins.quit = (_sitebuiltins.Quitter(name, "Ctrl-D (i.e. EOF)") for name in ("exit", "quit"))
    set_limit = sys.setrecursionlimit                   # deep but bounded (the program runs on a large stack,
    cap = min(10 ** 6, 1000 * memory_mb)                # frames take memory): a bomb ends in RecursionError
    sys.setrecursionlimit = lambda n: set_limit(min(n, cap))
    for name in ("ctypes", "_ctypes", "multiprocessing", "_posixsubprocess", "pty"):
        sys.modules[name] = None
    real_open, real_os_open = builtins.open, os.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def allowed(path, writing):
        if isinstance(path, int):
            return True
        full = os.path.realpath(os.fsdecode(path))
        if full.startswith("/proc"):
            return False
        return not writing or full == scratch or full.startswith(scratch + os.sep)

    def standard(path):                                 # /dev/stdout and the like: there is no /proc here
        if isinstance(path, (str, bytes)):
            name = os.fsdecode(path)
            for prefix in ("/dev/fd/", "/proc/self/fd/"):
                if name.startswith(prefix) and name[len(prefix):].isdigit():
                    return os.dup(int(name[len(prefix):]))
            if name in ("/dev/stdin", "/dev/stdout", "/dev/stderr"):
                return os.dup(("/dev/stdin", "/dev/stdout", "/dev/stderr").index(name))
        return path

    def guarded_open(file, mode="r", *args, **kwargs):
        file = standard(file)
        if not allowed(file, any(c in mode for c in "wax+")):
            raise PermissionError(f"sandbox: opening {file!r} with mode {mode!r} is not allowed")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        path = standard(path)
        if isinstance(path, int):
            return path
        if not allowed(path, flags & writes):
            raise PermissionError(f"sandbox: opening {path!r} is not allowed")
        return real_os_open(path, flags, *args, **kwargs)

    def confined(change, paths):                        # unlink, rename, ...: inside the scratch folder only
        def call(*args, **kwargs):
            folders = [kwargs.get("dir_fd")] if paths == 1 else [kwargs.get("src_dir_fd"), kwargs.get("dst_dir_fd")]
            full = []
            for path, folder in zip(args[:paths], folders):
                if folder is not None and not isinstance(path, int):   # relative to a folder's fd (shutil.rmtree)
                    try:
                        path = os.path.join(os.readlink(f"/proc/self/fd/{folder}"), os.fsdecode(path))
                    except OSError:                     # no /proc: in the mount namespace the kernel decides
                        path = path if isolated else "/"
                full.append(path)
            if not all(allowed(path, True) for path in full):
                raise PermissionError(f"sandbox: {change.__name__} of {args[:paths]!r} is not allowed")
            return change(*args, **kwargs)
        return call
    for module in (os, posix):
        for name, paths in (("remove", 1), ("unlink", 1), ("rmdir", 1), ("truncate", 1), ("chmod", 1), ("fchmod", 1),
                            ("rename", 2), ("replace", 2)):
            setattr(module, name, confined(getattr(posix, name), paths))
    builtins.open = io.open = guarded_open
    os.open = guarded_os_open


def _error(err):
    if isinstance(err, OSError) and err.errno == 27:             # EFBIG: RLIMIT_FSIZE on the output file
        return "RuntimeError: output limit exceeded (the output file is full)"
    return f"{type(err).__name__}: {err}"[-500:]


def _start(argv):
    """Common start of a child: cgroup, isolation, the job, stdin files, limits, seccomp.
    argv: role, "ns" | "plain", fds...; the job's "setup": the uid to run as and the cgroup.procs files to join
    (fds the trainer opened)."""
    job = receive(sys.stdin.buffer)
    setup = job.pop("setup")
    folder = "/tmp" if argv[1] == "ns" else None             # the run's own tmpfs: its own inode numbers
    if folder:
        _isolate(setup["uid"], setup["cgroup"], job["limits"]["memory_mb"])
    else:
        _join(setup["cgroup"])
    printing = argv[0] == "--run" and not job.get("fn_name")           # stdin / stdout: both files, made
    stdin = ([_stdin_file(given if isinstance(given, str) else "\n".join(map(str, given)), folder)   # before the
              for given in job["inputs"]] if printing else [])                                    # file size limit
    stdout = _scratch_file("stdout", folder) if printing else None
    _set_limits(job["limits"], rlimit_nproc=not setup["cgroup"], open_already=len(stdin))
    if sys.platform.startswith("linux"):
        ctypes, libc = _libc()
        if libc.prctl(38, 1, 0, 0, 0) != 0:                  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if not _seccomp() and _libseccomp() is not None:
            raise OSError("the seccomp filter did not load")
    _neutral_view()
    return job, [int(fd) for fd in argv[2:]], stdin, stdout


def _neutral_view():
    """Nothing of the trainer in what the program can read of its interpreter: the arguments it was started
    with (a program's own: none), the virtual environment's paths (under the checkout)."""
    sys.argv, sys.orig_argv = ["<program>"], ["python3", "<program>"]
    sys.prefix, sys.exec_prefix = sys.base_prefix, sys.base_exec_prefix
    sys.executable = sys._base_executable = os.path.join(sys.base_exec_prefix, "bin", "python3")


def _stdin_file(text, folder=None):
    """A file holding one input, read from its start (_scratch_file; None where there is none: a StringIO then)."""
    if folder is None and not hasattr(os, "memfd_create"):
        return None
    fd, data = _scratch_file("stdin", folder), text.encode("utf-8", "surrogateescape")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _use_stdin(fd, text):
    """sys.stdin for one input: a text file over a real fd 0, as CPython's (so .buffer, .mode, fileno(), open(0)
    and readline work)."""
    import io
    if fd is None:
        return io.StringIO(text)
    os.dup2(fd, 0)
    os.close(fd)
    return io.open(0, "r", encoding="utf-8", errors="surrogateescape", newline="\n", closefd=False)


def _with_a_large_stack(limits, fn, *args):
    """fn(*args) in a thread with a stack of a quarter of the address space limit (at most 256 MiB), so deep
    recursion through C (lru_cache, __eq__, sorted keys) ends at the recursion limit, not in a crash."""
    import threading
    try:
        threading.stack_size(min(256 << 20, (limits["memory_mb"] << 20) // 4) & ~0xFFFF)
        thread = threading.Thread(target=fn, args=args)
        thread.start()
    except (ValueError, RuntimeError, MemoryError):
        return fn(*args)
    finally:
        threading.stack_size(0)                              # the program's own threads: the default
    thread.join()


def _program_child(argv):
    """--run: the program against each input; --serve: the program's function called over pipes. Only
    outputs and plain values leave this process, one report line per test as it ends; the verdict is not
    decided here."""
    import _json  # noqa: F401 - the report's encoder, loaded before the program can use up every fd
    job, fds, stdin, stdout = _start(argv)
    report = os.fdopen(fds[0], "wb")
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as err:
        _report(report, {"compile_error": _error(err)}, job["limits"])
        return
    channels = [os.fdopen(fd, mode) for fd, mode in zip(fds[1:], ("rb", "w"))]
    isolated = argv[1] == "ns"
    stderr = _quiet_stderr()
    if argv[0] == "--serve" or job.get("fn_name"):        # what a function prints is nobody's output
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    _guard("/tmp" if isolated else os.path.realpath(os.getcwd()), job["limits"]["memory_mb"], isolated)
    import gc
    gc.freeze()                           # the collection after each input walks the program's objects only
    if argv[0] == "--serve":
        _with_a_large_stack(job["limits"], _serve, code, job, *channels)
    elif job["fn_name"]:
        _with_a_large_stack(job["limits"], _call_each, code, job, report)
    else:
        _with_a_large_stack(job["limits"], _run_inputs, code, job, stdin, stdout, report)
    os.dup2(stderr, 2)                    # this process's own errors from here on reach the trusted side


def _report(report, record, limits):
    """One report line (a test's output or error, or a compile error), sent at once; a line past the trusted side's
    cap on it is sent as an error instead. False when the trusted side wants no more (it has its verdict)."""
    text = _line(record)
    try:                                  # bytes printed that were not UTF-8 go back as they were
        line = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:            # a str value with a lone surrogate: a wrong answer, not a crash
        line = text.encode("utf-8", "surrogatepass")
    if len(line) > 6 * limits["output_bytes"] + (1 << 16):   # report_bytes: a value the child could send whole
        line = _line({"error": f"RuntimeError: output limit exceeded ({len(line)} bytes of report for one test)"})
        line = line.encode()
    try:
        report.write(line)
        report.flush()
        return True
    except (BrokenPipeError, ValueError):                   # closed by the trusted side, or by the program
        return False


def _module(name):
    """A fresh module for the program, registered in sys.modules as a program run by `python` is: pickle of its
    classes, dataclasses (ClassVar under `from __future__ import annotations`), sys.modules[__name__] work."""
    module = type(sys)(name)
    sys.modules[name] = module
    return module


def _scratch_file(name, folder=None):
    """An fd of an empty file of this process: unnamed in `folder` (the run's own tmpfs), else a memfd (its inode
    number is drawn from a counter of the whole host), else an unlinked file in the working folder."""
    if folder:
        return os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    fd = os.open(f".{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(f".{name}")
    return fd


def _quiet_stderr():
    """fd 2 (sys.stderr) on /dev/null while the program runs: judges ignore stderr, and a program's debug prints
    (a megabyte over its tests) would otherwise fill the capped pipe to the trusted side and die of EPIPE. Nothing
    on stderr decides a verdict, and the trusted side reads none of it. Returns fd 2 as it was, to put back."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return saved


def _use_stdout(fd):
    """fd 1 on an emptied file for one input, and sys.stdout a text file over fd 1 as CPython's would be
    (fileno(), mode, buffer), writing through to its buffer: print, sys.stdout.buffer, os.write(1, ...) and
    os.fdopen(1) all land in the file, in the order written. Its size is capped by RLIMIT_FSIZE."""
    import io
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.dup2(fd, 1)
    stdout = io.open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    stdout.reconfigure(write_through=True)
    return stdout


def _printed(fd, namespace):
    """What one input's program wrote to fd 1, after the end of a CPython process: its other non-daemon threads
    joined (a program often runs main in a thread with a larger stack and returns), its atexit functions run,
    sys.stdout flushed unless closed, its own files flushed as they are freed; read back from the file."""
    import atexit
    import gc
    import threading
    for hook in reversed(threading._threading_atexits):  # e.g. idle ThreadPoolExecutor workers are told to end
        hook()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and thread is not threading.main_thread() and not thread.daemon:
            thread.join()                                # the run's wall-clock limit still holds
    pool = sys.modules.get("concurrent.futures.thread")
    if pool is not None:
        pool._shutdown = False                           # the next input's executors may start again
    atexit._run_exitfuncs()
    atexit._clear()
    for stream in (sys.stdout, sys.__stdout__):
        if hasattr(stream, "flush") and not getattr(stream, "closed", False):
            stream.flush()
    namespace.clear()
    gc.collect()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "surrogateescape")


def _run_inputs(code, job, stdin, stdout, report):
    """stdin/stdout: the program run as its own `__main__` once per input, as `python program.py < input` would."""
    real = sys.stdout, sys.stdin, sys.__stdout__, sys.__stdin__, sys.modules.get("__main__")
    for i, given in enumerate(job["inputs"]):
        namespace = _module("__main__").__dict__
        try:
            sys.stdout = sys.__stdout__ = _use_stdout(stdout)     # __stdout__ keeps it alive when the program
                                                                   # wraps sys.stdout.buffer in a file of its own
            text = given if isinstance(given, str) else "\n".join(map(str, given))
            sys.stdin = sys.__stdin__ = _use_stdin(stdin[i], text)
            try:
                exec(code, namespace)
            except (SystemExit, ProgramExit) as stop:
                status = stop.code if isinstance(stop, SystemExit) else stop.args[0] if stop.args else None
                if status not in (None, 0):
                    raise
            record = {"out": _printed(stdout, namespace)}
        except BaseException as err:  # noqa: BLE001 - the program's own failure, whatever it is
            record = {"error": _error(err)}
        sys.stdout, sys.stdin, sys.__stdout__, sys.__stdin__, sys.modules["__main__"] = real
        if not _report(report, record, job["limits"]) or "error" in record:
            break


def _call_each(code, job, report):
    """Call-based (APPS's harness): the program imported once as a module of its own, its function (or the method
    of one `Solution()`) called once per test under what is left of the run's budget; what it prints goes to
    /dev/null (fd 1 is there), as APPS's harness ignores it."""
    import io
    sys.stdout = sys.__stdout__ = io.open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    namespace = _module("program").__dict__
    try:
        exec(code, namespace)
        fn = namespace.get(job["fn_name"])
        if fn is None and "Solution" in namespace:
            fn = getattr(namespace["Solution"](), job["fn_name"])
        if fn is None:
            raise NameError(f"no function {job['fn_name']!r}")
    except BaseException as err:  # noqa: BLE001
        _report(report, {"error": _error(err)}, job["limits"])
        return
    for given in job["inputs"]:
        try:
            value = fn(*given)
            try:
                record = {"out": encode(value)}
            except NotPlain as err:                      # compared as a wrong answer by the parent
                record = {"out": {"not_plain": str(err)}}
        except BaseException as err:  # noqa: BLE001 - SystemExit included: never a normal return
            record = {"error": _error(err)}
        if not _report(report, record, job["limits"]) or "error" in record:
            break


def _serve(code, job, calls, replies):
    """HumanEval: define the program (a module of its own; what it prints goes to /dev/null, as HumanEval's harness
    discards it), then answer the check's calls (plain arguments in, a plain value or an error out) until the
    check hangs up."""
    import io
    sys.stdout = sys.__stdout__ = io.open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    namespace = _module("program").__dict__
    try:
        exec(code, namespace)
        fn = namespace[job["entry_point"]]
    except BaseException as err:  # noqa: BLE001
        replies.write(_line({"error": _error(err)}))
        replies.flush()
        return
    while (args := receive(calls)) is not None:
        try:
            reply = {"out": encode(fn(*args))}
        except BaseException as err:  # noqa: BLE001 - SystemExit included: never a normal return
            reply = {"error": _error(err)}
        replies.write(_line(reply))
        replies.flush()


class _CandidateError(Exception):
    """The program's function raised, or sent back something that is not a plain value."""


def _check_child(argv):
    """--check: the dataset's prompt and test code (trusted text only) and check(candidate), where
    candidate is a proxy to the program's process. Reports {ok} / {assertion} / an error."""
    job, fds, _, _ = _start(argv)
    report, calls, replies = os.fdopen(fds[0], "w"), os.fdopen(fds[1], "wb"), os.fdopen(fds[2], "r")

    def candidate(*args):
        send(calls, list(args))
        line = replies.readline()
        if not line:
            raise _CandidateError("the program's process ended")
        reply = parse_line(line)
        if isinstance(reply, dict) and "error" in reply:
            raise _CandidateError(str(reply["error"]))
        try:
            return decode(reply["out"])
        except (KeyError, TypeError, NotPlain) as err:
            raise _CandidateError(f"not a plain value: {err}") from None

    namespace = {"__name__": "check"}
    try:
        exec(compile(job["prompt"] + "\n" + job["test"], "<test>", "exec"), namespace)
        namespace[job["entry_point"]] = candidate           # some checks call the function by its name
        namespace["check"](candidate)
        record = {"ok": True}
    except AssertionError as err:
        record = {"assertion": True, "detail": _error(err)}
    except BaseException as err:  # noqa: BLE001
        record = {"detail": _error(err)}
    report.write(_line(record))
    report.flush()


def main(argv):
    if argv[:1] == ["--check"]:
        prefix, _, _, _, layers = isolation()
        print("sandbox isolation layers on this machine:\n" + "\n".join(f"  - {layer}" for layer in layers))
        probe = run("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
                    "    print('network')\nexcept OSError:\n    print('no network')\n",
                    {"inputs": [""], "outputs": ["no network"]})
        print(f"probe (a program trying 127.0.0.1): {probe.outcome}")
        return 0 if probe.outcome == "passed" or not prefix else 1
    if argv[:1] in (["--run"], ["--serve"]):
        return _program_child(argv)
    if argv[:1] == ["--check-child"]:
        return _check_child(argv)
    if argv[:1] == ["--probe"]:      # isolation(): can a child isolate itself (and import, and filter) here?
        setup = receive(sys.stdin.buffer)
        _isolate(setup["uid"], setup["cgroup"])
        import hashlib, math, shutil, subprocess  # noqa: E401,F401 - the standard library is still importable
        _libc()[1].prctl(38, 1, 0, 0, 0)
        print("isolated", "seccomp" if _seccomp() else "")
        return 0
    print(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
