"""Run untrusted generated programs against tests: the execution reward of the code track (App. B.5).

    result = run(program, tests)              # -> Result(outcome, passed, failed, detail)
    result.reward                             # -1.0 compile error, -0.6 runtime error or timeout,
                                              # else -0.3 + 1.3 * passed / (passed + failed)
    results = run_many([(program, tests), ...])   # concurrently, one program per core

`tests` is one of three formats:
- APPS standard input / output: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}; outputs are compared
  line by line with trailing whitespace ignored;
- APPS call-based: the same with "fn_name" (a function, or a method of `class Solution`) and each input a
  list of arguments;
- HumanEval: {"test": "def check(candidate): ...", "entry_point": "name"}; one test, failed on AssertionError.

Each program runs in a child process of its own (`python -I -S sandbox.py --child`): a fresh temporary
working directory, an environment holding only PATH and LANG, limits on CPU time, address space, file size
and (for non-root users) processes, stdout/stderr to capped files, and its whole process group killed
at the wall-clock timeout. Inside the child, before the program runs, a guard removes what generated code
has no business calling: fork/exec/kill/system, subprocess, ctypes, deleting or renaming files, opening
files for writing outside the working directory, reading /proc. Outcomes: passed, failed,
runtime_error, compile_error, timeout; a timeout counts as a runtime error in the reward, and so does a
runtime error in any test (the program did not run to completion). This is defence in depth against
what a language model writes by accident, not a boundary against a determined attacker (no
namespaces or seccomp): run untrusted code at scale inside a container as well.
"""
import json
import os
import resource
import signal
import sys
from dataclasses import asdict, dataclass

OUTCOMES = ("passed", "failed", "runtime_error", "compile_error", "timeout")


@dataclass
class Result:
    outcome: str
    passed: int = 0
    failed: int = 0
    detail: str = ""

    @property
    def reward(self):
        if self.outcome == "compile_error":
            return -1.0
        if self.outcome in ("runtime_error", "timeout"):
            return -0.6
        total = self.passed + self.failed
        return -0.3 + 1.3 * self.passed / total if total else -0.3


@dataclass
class Limits:
    timeout: float = 4.0            # wall-clock seconds for the whole program and all its tests
    cpu_seconds: int = 4
    memory_mb: int = 1024           # address space
    output_bytes: int = 1 << 20     # per captured stream, and the largest file the program may write
    processes: int = 64             # RLIMIT_NPROC: counts all the user's tasks, threads included; the
                                    # kernel ignores it for root, where the guard alone stops fork()


def run(program, tests, limits=None):
    """Run one program against its tests in a sandboxed child; never raises for anything the program does."""
    import secrets, shutil, subprocess, tempfile   # noqa: E401 - parent side only: the child starts faster
    limits = limits or Limits()
    workdir = tempfile.mkdtemp(prefix="sandbox_")
    read_end, write_end = os.pipe()                      # the harness's verdict comes back on this pipe
    nonce = secrets.token_hex(8)                         # ... signed, so that the program cannot forge it
    try:
        err_path = os.path.join(workdir, ".stderr")
        with open(os.path.join(workdir, ".stdout"), "wb") as out, open(err_path, "wb") as err:
            # no preexec_fn (unsafe with run_many's threads): the child sets its own limits first thing
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "--child", str(write_end)],
                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, pass_fds=(write_end,),
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
        os.close(write_end)
        write_end = None
        try:
            proc.stdin.write(json.dumps({"program": program, "tests": tests, "nonce": nonce,
                                         "limits": asdict(limits)}).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = not _wait(proc, limits.timeout)
        _kill_group(proc.pid)                            # whatever it left running goes too
        verdict = _read_verdict(read_end, nonce)
        stderr = open(err_path, "rb").read(4000).decode(errors="replace")
    finally:
        os.close(read_end)
        if write_end is not None:
            os.close(write_end)
        shutil.rmtree(workdir, ignore_errors=True)
    if timed_out or proc.returncode == -signal.SIGXCPU:
        return Result("timeout", detail=f"killed after {limits.timeout} s (wall clock) or {limits.cpu_seconds} s (CPU)")
    if verdict is None:
        return Result("runtime_error", detail=f"the program died (exit {proc.returncode}): {stderr[-500:]}")
    return Result(verdict["outcome"], verdict.get("passed", 0), verdict.get("failed", 0), verdict.get("detail", ""))


def run_many(jobs, limits=None, workers=None):
    """[(program, tests)] -> [Result], at most one child per CPU core at a time."""
    from concurrent.futures import ThreadPoolExecutor
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run(job[0], job[1], limits), jobs))


def execution_reward(problems, responses, limits=None):
    """The code track's reward: each problem row's `prefix` + response run against its `tests`,
    concurrently. Returns (the paper's execution reward per response, 1.0 where every test passed)."""
    results = run_many([(row["prefix"] + text, row["tests"]) for row, text in zip(problems, responses)], limits)
    return [r.reward for r in results], [float(r.outcome == "passed") for r in results]


def _set_limits(limits):
    """The child's own limits, set before it reads the program."""
    cpu = max(1, int(limits["cpu_seconds"]))
    memory, size, nproc = limits["memory_mb"] << 20, limits["output_bytes"], limits["processes"]
    for name, value in [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_FSIZE, (size, size)), (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NPROC, (nproc, nproc))]:
        try:
            resource.setrlimit(name, value)
        except (ValueError, OSError):
            pass


def _wait(proc, timeout):
    import subprocess
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _read_verdict(fd, nonce):
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    for line in reversed(b"".join(chunks).decode(errors="replace").splitlines()):
        try:
            verdict = json.loads(line)
        except ValueError:
            continue
        if isinstance(verdict, dict) and verdict.get("nonce") == nonce and verdict.get("outcome") in OUTCOMES:
            return verdict
    return None


# ---------------------------------------------------------------- inside the child

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
    """Remove the process, signal and file-system calls generated code never needs."""
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


def _same_output(got, expected):
    def lines(text):
        return [line.rstrip() for line in str(text).strip().splitlines()]
    return lines(got) == lines(expected)


def _same_value(got, expected):
    def plain(x):
        return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x
    got, expected = plain(got), plain(expected)
    return got == expected or [got] == expected


def _child(fd):
    """Compile, guard, run every test; write {outcome, passed, failed, detail} to the verdict pipe."""
    job = json.loads(sys.stdin.read())
    _set_limits(job["limits"])
    verdict_pipe = os.fdopen(fd, "w")
    program, tests, nonce = job["program"], job["tests"], job.pop("nonce")

    def report(outcome, passed=0, failed=0, detail=""):
        verdict_pipe.write(json.dumps({"outcome": outcome, "passed": passed, "failed": failed,
                                       "detail": detail[-500:], "nonce": nonce}) + "\n")
        verdict_pipe.flush()

    extra = tests.get("test", "") if "entry_point" in tests else ""
    try:
        code = compile(program + ("\n" + extra if extra else ""), "<program>", "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as err:
        return report("compile_error", detail=f"{type(err).__name__}: {err}")
    workdir = os.path.realpath(os.getcwd())
    import io
    real_stdin, real_stdout = sys.stdin, sys.stdout
    _guard(workdir)
    passed = failed = 0
    cases = [(None, None)] if "entry_point" in tests else list(zip(tests["inputs"], tests["outputs"]))
    for given, expected in cases:
        out = _CappedOutput(job["limits"]["output_bytes"])
        sys.stdout = out
        namespace = {"__name__": "__main__" if "fn_name" not in tests and "entry_point" not in tests else "program"}
        try:
            if "entry_point" in tests:
                exec(code, namespace)
                try:
                    namespace["check"](namespace[tests["entry_point"]])
                    ok = True
                except AssertionError:
                    ok = False
            elif "fn_name" in tests:
                exec(code, namespace)
                fn = namespace.get(tests["fn_name"])
                if fn is None and "Solution" in namespace:
                    fn = getattr(namespace["Solution"](), tests["fn_name"])
                if fn is None:
                    raise NameError(f"no function {tests['fn_name']!r}")
                ok = _same_value(fn(*given), expected)
            else:
                sys.stdin = io.StringIO(given if isinstance(given, str) else "\n".join(map(str, given)))
                try:
                    exec(code, namespace)
                except SystemExit as stop:
                    if stop.code not in (None, 0):
                        raise
                ok = _same_output(out.getvalue(), expected)
        except BaseException as err:  # noqa: BLE001 - the program's own failure, whatever it is
            sys.stdout, sys.stdin = real_stdout, real_stdin
            return report("runtime_error", passed, failed, f"{type(err).__name__}: {err}")
        sys.stdout, sys.stdin = real_stdout, real_stdin
        passed, failed = passed + ok, failed + (not ok)
    report("passed" if failed == 0 else "failed", passed, failed)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    _child(int(sys.argv[2]))
