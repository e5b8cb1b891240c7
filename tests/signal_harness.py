"""What the tests that stop, signal and kill real ``opdkit train`` runs share (test_end_of_run.py,
test_rank_faults.py): faults planted through a ``sitecustomize``, waiting for a run to reach a point,
process states from /proc, checkpoints validated, and a warm runner for the plain reruns after a fault.

Validation runs ``opdkit validate``'s own code (``opdkit.cli.main``) in the test's process: a
``python -m opdkit validate`` process spends seconds of CPU importing torch and transformers for a
check of a fraction of a second, and these tests validate about twenty times.

``OpdkitRunner``: a process that imports opdkit, torch and transformers once and forks a fresh
child for each command (``opdkit.cli.main(argv)``, then the interpreter's normal exit, as
``python -m opdkit``): the child is a process of its own with its own exit status, stdout and
stderr, with nothing run before it but those imports. It serves the reruns, which only have to
resume; the runs that are signalled are always started as the launcher under test starts them.
Its ``python`` is an executable that stands in for the interpreter where run.sh runs one (``PYTHON``,
with ``env``): ``python -m opdkit ARGS`` runs in such a child, with the caller's working directory,
environment, stdin, stdout and stderr, and exits with the child's status; anything else is handed to
the real interpreter. Its ``helpers_python`` (``env(real_trainer=True)``) hands the trainer itself
(``-m opdkit train`` without ``--check``) to the real interpreter too, so that a run.sh under test
starts its trainer as it always does (in its process group, with the test's sitecustomize), and only
its preflight and its checkpoint validation run in children of the runner.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opdkit.persist.fsutil import list_checkpoints
from procs import env

REPO = Path(__file__).resolve().parents[1]


def write_sitecustomize(site: Path, code: str) -> Path:
    """``site/sitecustomize.py`` holding ``code`` (put ``site`` first on PYTHONPATH: every Python process of
    the run imports it at start-up); ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(code)
    return site


def output_tail(proc: subprocess.Popen, n: int = 3000) -> str:
    """The end of an ended ``proc``'s piped stdout and stderr (what explains an early end), if it gives them soon."""
    try:
        out, err = proc.communicate(timeout=10)  # a grandchild that holds the pipe open: give up after 10 s
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return ""
    return "\n".join(x[-n:] for x in (out, err) if isinstance(x, str) and x)


def wait_for(cond, proc: subprocess.Popen, timeout: float, what: str, poll: float = 0.05) -> None:
    """Until ``cond()``; fails if ``proc`` ends first (with its output's end) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}\n{output_tail(proc)}")
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(poll)


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``Z``: a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pids) -> set[int]:
    """Those of ``pids`` that still run (neither gone nor zombies)."""
    return {p for p in pids if proc_state(p) not in (None, "Z")}


def still_alive(pids, timeout: float = 10) -> set[int]:
    """Those of ``pids`` still running after up to ``timeout`` seconds (empty as soon as all have ended: a
    process signalled a moment ago, even by SIGKILL, may still be on its way out)."""
    deadline = time.monotonic() + timeout
    while (live := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether ``pid`` stops running (gone or a zombie) within ``timeout`` seconds."""
    return not still_alive([pid], timeout)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def validate(out: Path) -> list[str]:
    """Every checkpoint that survives in ``out``, validated by ``opdkit validate`` (all of them must be valid);
    their names."""
    from opdkit.cli import main

    ckpts = list_checkpoints(out / "checkpoints")
    if ckpts:
        said = io.StringIO()
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = main(["validate", *map(str, ckpts)])
        assert code == 0, said.getvalue()
    return [c.name for c in ckpts]


def leftovers(out: Path) -> list[str]:
    """Hidden (temporary) entries left in the checkpoints and state folders."""
    return sorted(p.name for d in (out / "checkpoints", out / "state") if d.is_dir() for p in d.iterdir()
                  if p.name.startswith("."))


# --- a warm runner for plain `opdkit` commands --------------------------------------------------------------------

_SERVER = r'''
import json, os, select, socket, sys
import opdkit.cli
for name in sys.argv[2:]:  # what every `opdkit train` imports anyway, once
    __import__(name)
assert os.listdir("/proc/self/task") == [str(os.getpid())], "threads before a fork"  # fork only a 1-thread process
listener = socket.socket(fileno=int(sys.argv[1]))  # bound and listening: the stand-in interpreter's commands

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

def from_stand_in(conn):
    # a command of the stand-in interpreter: its argv, cwd and environment, and its stdin, stdout and stderr;
    # a supervisor process forks the command's child, tells the stand-in its pid, then its exit status
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, got, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not msg:
            break
        data, fds = data + msg, fds + list(got)
    if os.fork() != 0:  # the server: on to the next command
        conn.close()
        for f in fds:
            os.close(f)
        return None
    listener.close()
    job = json.loads(data)
    pid = os.fork()
    if pid == 0:  # the command's child
        conn.close()
        for i, f in enumerate(fds):
            os.dup2(f, i)
        for f in fds:
            if f > 2:
                os.close(f)
        os.environ.clear()
        os.environ.update(job["env"])
        return job
    for f in fds:
        os.close(f)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)

def serve():
    said = b""
    while True:
        while b"\n" in said:  # a command of the test's own
            line, said = said.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                listener.close()
                return job
            print(json.dumps({"pid": pid}), flush=True)
            _, status = os.waitpid(pid, 0)
            print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
        reap()  # the stand-in's supervisors that have ended
        ready, _, _ = select.select([0, listener], [], [], 1.0)
        if listener in ready:
            job = from_stand_in(listener.accept()[0])
            if job is not None:
                return job
        if 0 in ready:
            got = os.read(0, 1 << 16)
            if not got:
                return None
            said += got

job = serve()
if job is None:  # the tests are done: nothing to flush or clean up here
    os._exit(0)
else:  # a fresh child: the command, then the interpreter's normal exit with main's status
    os.chdir(job["cwd"])
    if "stdout" in job:  # the test's command: no stdin, its output into the files it names
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
    sys.argv = ["opdkit", *job["argv"]]
    if job.get("code"):  # the test's own code first (a fault injected by patching a module)
        exec(compile(job["code"], "<test code>", "exec"), {"__name__": "__test_code__"})
    sys.exit(opdkit.cli.main(job["argv"]))
'''
# The stand-in interpreter (OpdkitRunner.python): `-m opdkit ARGS` in a child of the runner, else the real one.
_STAND_IN = r'''#!{python} -SE
import json, os, signal, socket, sys
argv = sys.argv[1:]
if argv[:2] != ["-m", "opdkit"] or ({real_trainer!r} and argv[2:3] == ["train"] and "--check" not in argv):
    os.execv({python!r}, [{python!r}, *argv])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({socket!r})
socket.send_fds(s, [json.dumps({{"argv": argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode() + b"\n"],
                [0, 1, 2])
said = s.makefile("rb")
pid = json.loads(said.readline())["pid"]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # passed on, as to the interpreter itself
    signal.signal(sig, lambda n, _: os.kill(pid, n))
line = said.readline()
status = json.loads(line)["status"] if line else 1
if status < 0:  # killed by a signal: so is this process
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
'''
# (not pandas nor pyarrow, which the runs import too: importing them starts a thread)
PRELOAD = ("opdkit.train", "opdkit.persist.checkpoints", "opdkit.embedded", "opdkit.recipes",
           "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto")


class OpdkitRunner:
    """``run(argv, logs)``: ``opdkit *argv`` in a child forked from a process that has imported opdkit, torch and
    transformers (in the environment ``env(PYTHONPATH=REPO)``); its exit status, stdout and stderr."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="opdkit-runner-"))  # (short: a socket's path has at most 107 bytes)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.dir / "socket"))  # bound before the runner starts: the stand-in may connect at once
        listener.listen(16)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(listener.fileno()), *PRELOAD],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env(PYTHONPATH=str(REPO)),
                                     pass_fds=[listener.fileno()])
        listener.close()
        self.said = b""  # what the runner wrote that is not read yet
        self.python, self.helpers_python = self.dir / "python", self.dir / "helpers" / "python"
        for path, real_trainer in ((self.python, False), (self.helpers_python, True)):
            path.parent.mkdir(exist_ok=True)
            path.write_text(_STAND_IN.format(python=sys.executable, socket=str(self.dir / "socket"),
                                             real_trainer=real_trainer))
            path.chmod(0o755)

    def run(self, argv: list[str], logs: Path, cwd: Path | None = None, timeout: float = 600,
            code: str = "") -> tuple[int, str, str]:
        """``code``: Python run in the child before the command (e.g. a fault patched into a module)."""
        logs.mkdir(parents=True, exist_ok=True)
        out, err = logs / "stdout.txt", logs / "stderr.txt"
        job = {"argv": [str(a) for a in argv], "cwd": str(cwd or Path.cwd()), "stdout": str(out), "stderr": str(err),
               "code": code}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        started = self._reply(300)  # (the runner's first command waits for its imports)
        assert started is not None, "the runner started no command within 300s"
        pid = started["pid"]
        done = self._reply(timeout)
        if done is None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            self._reply(60)  # its status: the runner is ready for the next command
        said = out.read_text(errors="replace"), err.read_text(errors="replace")
        assert done is not None, f"opdkit {' '.join(job['argv'])} did not end within {timeout}s:\n{said[1][-3000:]}"
        return done["status"], *said

    def _reply(self, timeout: float) -> dict | None:
        """The runner's next line (None if none came within ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.said:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            got = os.read(fd, 4096)
            assert got, f"the runner ended (exit {self.proc.poll()})"
            self.said += got
        line, self.said = self.said.split(b"\n", 1)
        return json.loads(line)

    def env(self, real_trainer: bool = False, **extra) -> dict:
        """``procs.env(**extra)`` with the stand-in interpreter as run.sh's ``PYTHON`` (``real_trainer``: the one
        that leaves the trainer to the real interpreter)."""
        return env(PYTHON=str(self.helpers_python if real_trainer else self.python), **extra)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
