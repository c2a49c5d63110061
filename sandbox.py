"""Run untrusted generated programs against tests: the execution reward of the code track (App. B.5).

    result = run(program, tests)              # -> Result(outcome, passed, failed, detail)
    result.reward                             # -1.0 compile error, -0.6 runtime error or timeout,
                                              # else -0.3 + 1.3 * passed / (passed + failed)
    results = run_many([(program, tests), ...])   # concurrently, one program per core
    python sandbox.py --check                 # which isolation layers hold on this machine

`tests` is one of three formats:
- APPS standard input / output: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}; outputs are compared
  line by line with trailing whitespace ignored;
- APPS call-based: the same with "fn_name" (a function, or a method of `class Solution`) and each input a
  list of arguments;
- HumanEval: {"test": "def check(candidate): ...", "entry_point": "name", "prompt": "..."}; one test,
  failed on AssertionError.

An RL policy learns whatever the reward really measures, so the trusted side decides every verdict and the
untrusted program never holds an expected output, a test's result or the report channel:
- stdin/stdout: the program's process sends back what it printed for each input; this process compares;
- call-based: the program's process receives only the inputs and sends back plain values (None, bool,
  int, float, str and lists / tuples / dicts of them, exact types: no subclass, no object with its own
  `==`); this process compares. Anything else fails the test;
- HumanEval: `check(candidate)` runs in a process of its own holding only trusted text (the dataset's
  prompt and test code); `candidate` there is a proxy whose calls go to the program's process over pipes
  and come back as plain values;
- an early exit, SystemExit, a crash or a timeout is never a pass.

Isolation of the program's process, where the machine allows it (Linux as root, or unprivileged user
namespaces): its own network namespace (no network, not even 127.0.0.1), mount namespace (a private tmpfs
over /tmp, /var/tmp, /run/lock and /dev/shm is the only writable place), PID namespace (every process it
starts dies with it; no other process is visible in /proc) and IPC namespace; as root, an unprivileged uid
(65534) with no_new_privs, so RLIMIT_NPROC holds and nothing of root's is writable or readable through
/proc. Always: limits on CPU time, address space, file size and processes, no core files, a wall-clock
timeout that kills the whole process group, an environment of only PATH and LANG, captured output capped,
and an in-process guard that removes fork/exec/kill/system, subprocess, ctypes and file deletion (an extra
layer, not a boundary). Where a layer is unavailable the first run warns once and names the active ones.
This is not a hardened jail (no seccomp filter, the kernel is shared): for untrusted code at scale, run
the trainer in a container or VM as well.
"""
import marshal
import os
import resource
import signal
import sys

OUTCOMES = ("passed", "failed", "runtime_error", "compile_error", "timeout")
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")   # world-writable: covered by a private tmpfs
NAMESPACES = ["--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc"]


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


class Limits:
    def __init__(self, timeout=4.0, cpu_seconds=4, memory_mb=1024, output_bytes=1 << 20, processes=64, uid=65534):
        self.timeout = timeout              # wall-clock seconds for the whole program and all its tests
        self.cpu_seconds = cpu_seconds
        self.memory_mb = memory_mb          # address space
        self.output_bytes = output_bytes    # per captured stream, and the largest file the program may write
        self.processes = processes          # RLIMIT_NPROC: all of the sandbox uid's tasks, threads included
        self.uid = uid                      # the unprivileged user programs run as (when this process is root)


# Messages between processes. Trusted -> untrusted (the job, the check's calls): marshal, framed by its
# length (fast, and only ever read by the side that cannot be harmed by it). Untrusted -> trusted (outputs,
# values): one line of Python literal syntax, read with ast.literal_eval (safe on any text) and then
# `decode` (strict). Neither side needs json, whose import alone costs a child 10 ms.

def send(stream, value):
    data = marshal.dumps(value)
    stream.write(len(data).to_bytes(4, "little") + data)
    stream.flush()


def receive(stream):
    size = stream.read(4)
    if len(size) < 4:
        return None
    return marshal.loads(stream.read(int.from_bytes(size, "little")))


def parse_line(line):
    """One untrusted literal line -> its value, or None when it is not a literal."""
    import ast
    try:
        return ast.literal_eval(line)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


# ---------------------------------------------------------------- plain values across processes

class NotPlain(TypeError):
    """A value that is not None, bool, int, float, str, or a list / tuple / dict of them."""


def encode(x):
    """A plain value -> JSON, tuples and non-finite floats tagged; exact types only, so an object with
    its own `==` (or a subclass of int or str) cannot pass for the value it claims to be."""
    kind = type(x)
    if x is None or kind in (bool, int, str):
        return x
    if kind is float:
        return x if x == x and abs(x) != float("inf") else {"float": repr(x)}
    if kind is list:
        return [encode(v) for v in x]
    if kind is tuple:
        return {"tuple": [encode(v) for v in x]}
    if kind is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in x.items()]}
    raise NotPlain(f"a {kind.__name__} is not a plain value")


def _line(value):
    """An encoded plain value as one line of literal syntax (repr of exact builtin types)."""
    return repr(value) + "\n"                  # repr escapes newlines: always one line


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
        if tag == "tuple" and type(value) is list:
            return tuple(decode(v) for v in value)
        if tag == "dict" and type(value) is list and all(type(kv) is list and len(kv) == 2 for kv in value):
            return {decode(k): decode(v) for k, v in value}
    raise NotPlain(f"not an encoded plain value: {str(x)[:80]}")


def _same_output(got, expected):
    def lines(text):
        return [line.rstrip() for line in str(text).strip().splitlines()]
    return lines(got) == lines(expected)


def _same_value(got, expected):
    def plain(x):
        return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x
    got, expected = plain(got), plain(expected)
    return got == expected or [got] == expected


# ---------------------------------------------------------------- the trusted side

_ISOLATION = None


def isolation():
    """(unshare command prefix or [], drop to an unprivileged uid?, the layers that hold), probed once."""
    global _ISOLATION
    if _ISOLATION is None:
        import shutil
        import subprocess
        root = os.geteuid() == 0
        prefix, drop = [], False
        unshare = shutil.which("unshare")
        # the real start of a child (mounts, then the uid), tried from the most isolated setting down
        candidates = ([(NAMESPACES, True), (NAMESPACES, False)] if root else []) + [
            (["--user", "--map-root-user", *NAMESPACES], False)]
        for flags, with_uid in (candidates if unshare and sys.platform.startswith("linux") else []):
            probe = [unshare, *flags, sys.executable, "-I", "-S", os.path.abspath(__file__), "--probe", "ns",
                     str(Limits().uid if with_uid else -1)]
            try:
                ok = subprocess.run(probe, capture_output=True, timeout=20, cwd="/").stdout.strip() == b"isolated"
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if ok:
                prefix, drop = [unshare, *flags], with_uid
                break
        layers = (["network namespace: no network, not even 127.0.0.1",
                   "mount namespace: a private tmpfs is the only writable place",
                   "PID namespace: every process of the program dies with it; no other process in /proc",
                   "IPC namespace"] if prefix else [])
        layers += ([f"unprivileged uid {Limits().uid} with no_new_privs: RLIMIT_NPROC holds, root's files and /proc "
                    "entries out of reach"] if drop else [])
        layers += ["rlimits: CPU time, address space, file size, processes (not for root), no core files",
                   "wall-clock timeout; the whole process group is killed",
                   "environment scrubbed to PATH and LANG; output capped",
                   "in-process guard: fork/exec/kill/system, subprocess, ctypes, file deletion removed"]
        _ISOLATION = (prefix, drop, layers)
        if not prefix or not drop:
            print("[sandbox] warning: " + ("no namespaces on this machine (needs Linux with unshare, as root or "
                  "with unprivileged user namespaces)" if not prefix else "programs keep this process's uid") +
                  "; active layers: " + "; ".join(layers), file=sys.stderr)
    return _ISOLATION


def _spawn(role, job, fds, limits):
    """Start `sandbox.py <role>` in its own session (and namespaces), send it `job` on stdin; returns
    (process, stdout path, stderr path, its folder)."""
    import subprocess
    import tempfile
    prefix, drop, _ = isolation()
    folder = tempfile.mkdtemp(prefix=f"sandbox_{os.getpid()}_")        # whose it is, for leak checks
    out_path, err_path = os.path.join(folder, ".stdout"), os.path.join(folder, ".stderr")
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), role, "ns" if prefix else "plain",
            str(limits.uid if drop else -1), *map(str, fds)]
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # no preexec_fn (unsafe with run_many's threads): the child sets its own limits first thing
        proc = subprocess.Popen(prefix + argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=folder,
                                pass_fds=fds, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
    try:
        send(proc.stdin, {**job, "limits": vars(limits)})
        proc.stdin.close()
    except BrokenPipeError:
        pass
    return proc, out_path, err_path, folder


def _finish(procs, deadline):
    """Wait for every process until the deadline, then kill each whole group; True if all ended in time."""
    import subprocess
    import time
    in_time = True
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            in_time = False
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)          # whatever it left running goes too
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return in_time


def _read_last_record(fd):
    """The last dict on a pipe, one literal per line (or None)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    for line in reversed(b"".join(chunks).decode(errors="replace").splitlines()):
        record = parse_line(line)
        if isinstance(record, dict):
            return record
    return None


def run(program, tests, limits=None):
    """Run one program against its tests; never raises for anything the program does."""
    import shutil
    import time
    limits = limits or Limits()
    humaneval = "entry_point" in tests
    result_r, result_w = os.pipe()                           # the program's process -> this one
    if humaneval:                 # the check's process: calls to the program's process, replies, its verdict
        (calls_r, calls_w), (replies_r, replies_w), (check_r, check_w) = os.pipe(), os.pipe(), os.pipe()
        jobs = [("--serve", {"program": program, "entry_point": tests["entry_point"]}, (result_w, calls_r, replies_w)),
                ("--check-child", {"prompt": tests.get("prompt", ""), "test": tests["test"], "entry_point": tests["entry_point"]},
                 (check_w, calls_w, replies_r))]
        reads = [result_r, check_r]
    else:
        jobs = [("--run", {"program": program, "inputs": tests["inputs"], "fn_name": tests.get("fn_name")},
                 (result_w,))]
        reads = [result_r]
    started, folders = [], []
    deadline = time.monotonic() + limits.timeout
    try:
        for role, payload, fds in jobs:
            proc, _, err_path, folder = _spawn(role, payload, fds, limits)
            started.append((proc, err_path))
            folders.append(folder)
        for _, _, fds in jobs:                              # the children hold their ends now
            for fd in fds:
                os.close(fd)
        in_time = _finish([p for p, _ in started], deadline)
        record = _read_last_record(result_r)
        check = _read_last_record(check_r) if humaneval else None
        stderr = open(started[0][1], "rb").read(4000).decode(errors="replace")
    finally:
        for fd in reads:
            os.close(fd)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    code = started[0][0].returncode
    if record and "compile_error" in record:
        return Result("compile_error", detail=str(record["compile_error"]))
    if not in_time or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return Result("timeout", detail=f"killed after {limits.timeout} s (wall clock) or {limits.cpu_seconds} s (CPU)")
    if humaneval:
        return _check_verdict(check)
    return _verdict(record, tests, f"the program died (exit {code}): {stderr[-500:]}")


def _verdict(record, tests, died):
    """Compare what the program's process sent back with the expected outputs, which it never saw."""
    results = record.get("results") if record else None
    if not isinstance(results, list):
        return Result("runtime_error", detail=died)
    passed = failed = 0
    for i, expected in enumerate(tests["outputs"]):
        got = results[i] if i < len(results) else None
        if not isinstance(got, dict) or "error" in got or "out" not in got:
            detail = str(got.get("error", "")) if isinstance(got, dict) else "no result"
            return Result("runtime_error", passed, failed, detail if i < len(results) else died)
        try:
            value = decode(got["out"])
            ok = _same_value(value, expected) if "fn_name" in tests else _same_output(value, expected)
        except NotPlain:
            ok = False
        passed, failed = passed + ok, failed + (not ok)
    return Result("passed" if failed == 0 else "failed", passed, failed)


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

def _isolate(uid):
    """In the new namespaces, still root there: a private tmpfs over every world-writable folder, a
    working folder in it, then (as root on the host) the unprivileged uid with no_new_privs."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, options):
        if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      options and options.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {target}")
    nosuid_nodev, bind = 2 | 4, 4096 | 16384                # MS_NOSUID | MS_NODEV, MS_BIND | MS_REC
    for folder in WRITABLE_DIRS:
        if os.path.isdir(folder):
            mount("tmpfs", folder, "tmpfs", nosuid_nodev, "size=64m,mode=1777")
    os.mkdir("/tmp/work", 0o700)
    if uid >= 0:
        # the interpreter may live where the sandbox uid cannot go (/root/.pyenv under a 0700 /root): a
        # tmpfs over the first folder it cannot traverse (hiding the rest of it), the path made again
        # in it, the interpreter's own folder bound back in; programs can import the standard library
        prefix = os.path.realpath(sys.base_prefix)
        parts = prefix.split(os.sep)
        closed = next((os.sep.join(parts[:i]) for i in range(2, len(parts) + 1)
                       if not os.stat(os.sep.join(parts[:i])).st_mode & 0o001), None)
        if closed:
            os.mkdir("/tmp/.prefix", 0o755)
            mount(prefix, "/tmp/.prefix", None, bind, None)
            mount("tmpfs", closed, "tmpfs", nosuid_nodev, "size=1m,mode=755")
            os.makedirs(prefix, 0o755, exist_ok=True)
            mount("/tmp/.prefix", prefix, None, bind, None)
        os.chown("/tmp/work", uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if libc.prctl(38, 1, 0, 0, 0) != 0:                  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.chdir("/tmp/work")


def _set_limits(limits, rlimit_nproc=True):
    cpu = max(1, int(limits["cpu_seconds"]))
    memory, size, nproc = limits["memory_mb"] << 20, limits["output_bytes"], limits["processes"]
    for name, value in [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (size, size)), (resource.RLIMIT_CORE, (0, 0))] + (
                       [(resource.RLIMIT_NPROC, (nproc, nproc))] if rlimit_nproc else []):
        try:
            resource.setrlimit(name, value)
        except (ValueError, OSError):
            pass


class _CappedOutput:
    """stdout for the program: text up to `limit` characters, then an error (a flood of output)."""

    def __init__(self, limit):
        self.parts, self.size, self.limit = [], 0, limit

    def write(self, text):
        self.size += len(text)
        if self.size > self.limit:
            raise RuntimeError(f"output limit of {self.limit} characters exceeded")
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass

    def getvalue(self):
        return "".join(self.parts)


def _guard(workdir):
    """Remove the process, signal and file-system calls generated code never needs (an extra layer)."""
    import builtins
    import io
    import posix
    import shutil as shutil_
    import subprocess as subprocess_
    os.environ.clear()                                  # before unsetenv goes
    for module in (os, posix):
        for name in ("fork", "forkpty", "vfork", "kill", "_exit", "abort", "killpg", "system", "popen", "execv", "execve", "execvp",
                     "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
                     "spawnl", "spawnle", "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir", "removedirs",
                     "rename", "renames", "replace", "truncate", "chmod", "chown", "lchown", "fchmod", "fchown",
                     "setuid", "setgid", "setsid", "putenv", "unsetenv", "register_at_fork", "symlink", "link"):
            if hasattr(module, name):          # deleted, not set to None: code that asks hasattr()
                delattr(module, name)           # (random's register_at_fork) carries on without it
    for module, names in [(signal, ("pthread_kill", "pthread_sigmask")),
                          (subprocess_, ("Popen", "run", "call", "check_call", "check_output", "getoutput")),
                          (shutil_, ("rmtree", "move"))]:
        for name in names:
            delattr(module, name)
    set_limit = sys.setrecursionlimit                   # deep but bounded: a recursion bomb ends in
    sys.setrecursionlimit = lambda n: set_limit(min(n, 20000))      # RecursionError, not a crash
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
        return not writing or full == workdir or full.startswith(workdir + os.sep)

    def guarded_open(file, mode="r", *args, **kwargs):
        if not allowed(file, any(c in mode for c in "wax+")):
            raise PermissionError(f"sandbox: opening {file!r} with mode {mode!r} is not allowed")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if not allowed(path, flags & writes):
            raise PermissionError(f"sandbox: opening {path!r} is not allowed")
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = io.open = guarded_open
    os.open = guarded_os_open


def _error(err):
    return f"{type(err).__name__}: {err}"[-500:]


def _start(argv):
    """Common start of a child: isolation, limits, the job. argv: role, "ns" | "plain", uid, fds..."""
    if argv[1] == "ns":
        _isolate(int(argv[2]))
    job = receive(sys.stdin.buffer)
    _set_limits(job["limits"])
    return job, [int(fd) for fd in argv[3:]]


def _program_child(argv):
    """--run: the program against each input; --serve: the program's function called over pipes. Only
    outputs and plain values leave this process; the verdict is not decided here."""
    import io
    job, fds = _start(argv)
    report = os.fdopen(fds[0], "w")
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as err:
        report.write(_line({"compile_error": _error(err)}))
        report.flush()
        return
    real_stdout, real_stdin = sys.stdout, sys.stdin
    channels = [os.fdopen(fd, mode) for fd, mode in zip(fds[1:], ("rb", "w"))]
    _guard(os.path.realpath(os.getcwd()))
    if argv[0] == "--serve":
        return _serve(code, job, *channels)
    results = []
    for given in job["inputs"]:
        out = _CappedOutput(job["limits"]["output_bytes"])
        namespace = {"__name__": "__main__" if not job["fn_name"] else "program"}
        sys.stdout = out
        try:
            if job["fn_name"]:
                exec(code, namespace)
                fn = namespace.get(job["fn_name"])
                if fn is None and "Solution" in namespace:
                    fn = getattr(namespace["Solution"](), job["fn_name"])
                if fn is None:
                    raise NameError(f"no function {job['fn_name']!r}")
                value = fn(*given)
                sys.stdout = real_stdout
                try:
                    results.append({"out": encode(value)})
                except NotPlain as err:                      # compared as a wrong answer by the parent
                    results.append({"out": {"not_plain": str(err)}})
            else:
                sys.stdin = io.StringIO(given if isinstance(given, str) else "\n".join(map(str, given)))
                try:
                    exec(code, namespace)
                except SystemExit as stop:
                    if stop.code not in (None, 0):
                        raise
                results.append({"out": out.getvalue()})
        except BaseException as err:  # noqa: BLE001 - the program's own failure, whatever it is
            sys.stdout, sys.stdin = real_stdout, real_stdin
            results.append({"error": _error(err)})
            break
        sys.stdout, sys.stdin = real_stdout, real_stdin
    report.write(_line({"results": results}))
    report.flush()


def _serve(code, job, calls, replies):
    """HumanEval: define the program, then answer the check's calls (plain arguments in, a plain value
    or an error out) until the check hangs up."""
    namespace = {"__name__": "program"}
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
    job, fds = _start(argv)
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
        prefix, drop, layers = isolation()
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
    if argv[:1] == ["--probe"]:                  # isolation(): can a child isolate itself (and import) here?
        _isolate(int(argv[2]))
        import math, shutil, subprocess  # noqa: E401,F401 - the standard library is still importable
        print("isolated")
        return 0
    print(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
