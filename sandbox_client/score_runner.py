"""The judge of a scoring run: runs the hidden tests and writes the report; never runs the agent's code.

Why it exists: a test command's exit code is not evidence, and neither is any result computed in a
process the agent's code runs in: a module under test that runs inside pytest can register hooks,
rewrite the report writer, read the test's expected values off the caller's frame or return an
object equal to everything. So the agent's code never runs here.

The scorer starts two processes in the scoring sandbox with one exec (the server's
``peer_command``): this judge (``python -I -B -c SOURCE``) as the sandbox's *judge uid*, and the
peer (``score_peer``) as the sandbox's own uid, connected by three pipes. The judge:

- reads its payload (nonce, hidden files, test command, deadline) from stdin and writes the hidden
  files into a fresh ``0700`` folder of its own under ``/tmp``: the agent's uid cannot read them,
  nor this process's memory, file descriptors or frames (another uid; non-dumpable);
- sends its own stdout and stderr (pytest's output, which shows values the agent chose) to a file
  in that folder, and writes the one report line ``SCORE-REPORT <nonce> <json>`` on a saved copy of
  the original stdout, which no other process holds;
- runs pytest in-process with ``-c`` an empty ini, ``--rootdir``/``--confcutdir`` at its folder,
  plugin autoload off and ``PYTEST_*`` cleared: nothing in the workspace is read;
- imports the agent's modules as *proxies*: a hidden test's ``from lru import LRUCache`` finds no
  ``lru`` on the judge's path (the workspace is not on it; the standard library and installed
  packages always win), so a last-resort finder asks the peer to import it. Calls, attribute reads,
  ``len``/``in``/iteration/indexing go to the peer as JSON; results come back as plain values
  (``list``, ``dict``, ``Decimal``, ``date``...) or as references to objects that stay in the peer,
  which compare equal only to themselves. Exceptions come back as the builtin exception class they
  derive from. Lists, dicts and sets the tests pass (also inside other values) stay here: the
  peer gets a copy that sends each of its writes back as the container's new contents, applied to
  the real one, so a mutation is seen whatever the peer later says; functions passed as arguments (``key=``) are called back here. ``os.environ``
  changes (``monkeypatch.setenv``) are sent with each call;
- counts each test's phases from its own in-memory records (no file, no fd);
- at the deadline writes a timed-out report and exits, whatever the peer or a test is doing.

Script tasks (``python HIDDEN_SCRIPT``) run the hidden script here with ``runpy`` (cwd: the workspace, agent modules as
proxies); its exit status (``SystemExit``) is its one result.

Without a second uid (a server that is not root) the judge runs as the sandbox's uid: the agent's
process could then read the hidden files while they exist. docs/sandbox.md lists what is and is
not covered.
"""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import ctypes
import datetime
import decimal
import fractions
import json
import os
import select
import sys
import threading
import time

REPORT_PREFIX = "SCORE-REPORT"
_MAX_MESSAGE_BYTES = 16 << 20
_OUTPUT_TAIL_BYTES = 16_000
_PR_SET_DUMPABLE = 4
_VALUES = (type(None), bool, int, float, str)


class PeerError(Exception):
    """The agent's process broke the protocol, died or sent something that is not a value."""


# ---- the channel to the peer ---------------------------------------------------------------------
class Channel:
    """Requests to the peer and its replies, one JSON line each, bounded by the run's deadline."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self.write_fd, self.read_fd, self.deadline = write_fd, read_fd, deadline
        self.buffer = b""
        self.callbacks: dict[int, object] = {}
        self.held: dict[int, list | dict | set] = {}  # the tests' containers the peer holds references to
        self.sent_env: dict[str, str] | None = None
        os.set_blocking(write_fd, False)

    def _send(self, message: dict) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        while data:
            if not select.select([], [self.write_fd], [], self._left())[1]:
                raise PeerError("the agent's process stopped reading")
            try:
                data = data[os.write(self.write_fd, data):]
            except (BrokenPipeError, BlockingIOError) as exc:
                if isinstance(exc, BrokenPipeError):
                    raise PeerError("the agent's process exited") from None

    def _receive(self) -> dict:
        while b"\n" not in self.buffer:
            if not select.select([self.read_fd], [], [], self._left())[0]:
                raise PeerError("no answer from the agent's process before the deadline")
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise PeerError("the agent's process exited")
            self.buffer += chunk
            if len(self.buffer) > _MAX_MESSAGE_BYTES:
                raise PeerError("the agent's process sent a message over 16 MiB")
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            raise PeerError("the agent's process sent something that is not JSON") from None
        if not isinstance(message, dict):
            raise PeerError("the agent's process sent something that is not a message")
        return message

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def request(self, message: dict):
        if message["op"] == "call":
            # what the tests set (monkeypatch.setenv) goes with the call; pytest's own variables never
            # do: PYTEST_CURRENT_TEST names the running test, an oracle for a module that reads it
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
            if env != self.sent_env:
                message["env"] = self.sent_env = env
        self._send(message)
        while True:
            reply = self._receive()
            if "callback" in reply:
                self._send(self._run_callback(reply))
                continue
            if "write" in reply:
                self._send(self._apply_write(reply))
                continue
            if reply.get("stop"):
                raise StopIteration
            if "error" in reply:
                raise _remote_exception(reply["error"])
            if "ok" not in reply:
                raise PeerError("the agent's process sent a reply without a value")
            return decode(reply["ok"])

    def _apply_write(self, message: dict) -> dict:
        """The peer changed a container of the tests' (it holds a reference): give the real one its new contents."""
        target = self.held.get(message["write"]) if isinstance(message["write"], int) else None
        state = decode({"$t": type(target).__name__, "v": message.get("v")}) if target is not None else None
        if type(state) is not type(target):
            raise PeerError("the agent's process wrote to something that is not a container of the tests'")
        if isinstance(target, list):
            target[:] = state
        else:
            target.clear()
            target.update(state)
        return {"ok": None}

    def _run_callback(self, message: dict) -> dict:
        function = self.callbacks.get(message.get("callback"))
        if function is None:
            raise PeerError("the agent's process called back a function it was never given")
        try:
            args = [decode(a) for a in message.get("args", [])]
            kwargs = {str(k): decode(v) for k, v in dict(message.get("kwargs", {})).items()}
            return {"ok": encode(function(*args, **kwargs))}
        except Exception as exc:
            return {"error": {"name": type(exc).__name__, "message": str(exc),
                              "bases": [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]}}


_channel: Channel | None = None


# ---- values: what crosses the pipe -----------------------------------------------------------------
def encode(value):
    # The peer (score_peer.py) has its own copy of the standard values' tags: each side is one
    # standalone source run as `python -c`; tests/sandbox/test_scoring.py round-trips every tag.
    kind = type(value)
    if kind in _VALUES:
        return value
    if kind in (list, dict, set):  # stays here; the peer gets a copy whose every write comes back to it
        assert _channel is not None
        _channel.held[id(value)] = value
        items = [[encode(k), encode(v)] for k, v in value.items()] if kind is dict else [encode(v) for v in value]
        return {"$t": "held", "id": id(value), "kind": kind.__name__, "v": items}
    if kind in (tuple, frozenset):
        return {"$t": kind.__name__, "v": [encode(v) for v in value]}
    if kind is bytes:
        return {"$t": "bytes", "v": base64.b64encode(value).decode()}
    if kind in (decimal.Decimal, fractions.Fraction):
        return {"$t": kind.__name__.lower(), "v": str(value)}
    if kind is complex:
        return {"$t": "complex", "v": [value.real, value.imag]}
    if kind is range:
        return {"$t": "range", "v": [value.start, value.stop, value.step]}
    if kind in (datetime.date, datetime.datetime, datetime.time):
        return {"$t": kind.__name__, "v": value.isoformat()}
    if kind is datetime.timedelta:
        return {"$t": "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, Remote):
        return {"$t": "ref", "id": object.__getattribute__(value, "_id")}
    if isinstance(value, type) and value in _exception_ids:
        return {"$t": "ref", "id": _exception_ids[value]}
    if callable(value):
        assert _channel is not None
        _channel.callbacks[id(value)] = value
        return {"$t": "cb", "id": id(value)}
    raise TypeError(f"a {kind.__name__} cannot be passed to the module under test (plain values only)")


_DECODERS = {
    "list": lambda v: [decode(x) for x in v], "tuple": lambda v: tuple(decode(x) for x in v),
    "set": lambda v: {decode(x) for x in v}, "frozenset": lambda v: frozenset(decode(x) for x in v),
    "dict": lambda v: {decode(k): decode(x) for k, x in v}, "bytes": base64.b64decode,
    "decimal": decimal.Decimal, "fraction": fractions.Fraction, "complex": lambda v: complex(*v),
    "range": lambda v: range(*(int(x) for x in v)),
    "date": datetime.date.fromisoformat, "datetime": datetime.datetime.fromisoformat,
    "time": datetime.time.fromisoformat, "timedelta": lambda v: datetime.timedelta(*v),
}


def decode(data):
    """A plain value, a Remote, or a local exception class; PeerError for anything else."""
    if isinstance(data, _VALUES):
        return data
    if not isinstance(data, dict):
        raise PeerError(f"the agent's process sent a bare {type(data).__name__}")
    tag = data.get("$t")
    try:
        if tag == "held":
            assert _channel is not None
            return _channel.held[data["id"]]
        if tag == "ref":
            if data.get("kind") == "exception_class":
                return _exception_class(data.get("name"), data.get("bases"), data.get("id"))
            return Remote(int(data["id"]), str(data.get("kind")), str(data.get("name"))[:200])
        return _DECODERS[tag](data["v"])
    except PeerError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError, RecursionError):
        raise PeerError(f"the agent's process sent an invalid {str(tag)[:40]!r} value") from None


_exception_classes: dict[tuple, type] = {}
_exception_ids: dict[type, int] = {}


def _exception_class(name, bases, remote_id) -> type:
    """A local class standing for an exception class of the agent's, under its builtin bases."""
    builtin_bases = [getattr(builtins, str(b), None) for b in (bases or [])]
    base = next((b for b in builtin_bases if isinstance(b, type) and issubclass(b, Exception)), Exception)
    key = (str(name)[:200], base, remote_id)
    if key not in _exception_classes:
        cls = type(str(name)[:200] if str(name).isidentifier() else "RemoteError", (base,), {})
        _exception_classes[key] = cls
        if isinstance(remote_id, int):
            _exception_ids[cls] = remote_id
    return _exception_classes[key]


def _remote_exception(info) -> Exception:
    if not isinstance(info, dict):
        return PeerError("the agent's process sent an invalid error")
    cls = _exception_class(info.get("name"), info.get("bases"), info.get("id"))
    args = info.get("args")
    if isinstance(args, list) and all(type(a) in (str, int, float, bool, type(None)) for a in args):
        try:
            return cls(*args)  # the exception's own arguments (KeyError('x').args == ('x',))
        except Exception:  # a base that needs other arguments (UnicodeDecodeError): the message
            pass
    return cls(str(info.get("message", ""))[:4000])


# ---- proxies -------------------------------------------------------------------------------------
class Remote:
    """An object that lives in the agent's process. Equal only to itself; everything else is a request."""

    __slots__ = ("_id", "_kind", "_name")

    def __init__(self, number: int, kind: str, name: str) -> None:
        object.__setattr__(self, "_id", number)
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_name", name)

    def _ask(self, op: str, **fields):
        assert _channel is not None
        return _channel.request({"op": op, "target": {"$t": "ref", "id": object.__getattribute__(self, "_id")},
                                 **fields})

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # introspection (pytest, inspect): not the agent's
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", name=name, value=encode(value))

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=[encode(a) for a in args],
                         kwargs={k: encode(v) for k, v in kwargs.items()})

    def _op(self, name: str, *args):
        return self._ask("op", name=name, args=[encode(a) for a in args])

    def __len__(self):
        return _checked(self._op("len"), int)

    def __iter__(self):
        return self._op("iter")

    def __next__(self):
        return self._op("next")

    def __contains__(self, item):
        return _checked(self._op("contains", item), bool)

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __setitem__(self, key, value):
        self._op("setitem", key, value)

    def __delitem__(self, key):
        self._op("delitem", key)

    def __bool__(self):
        return _checked(self._op("bool"), bool)

    def __repr__(self):
        try:
            return f"<remote {self._name}: {_checked(self._op('repr'), str)[:2000]}>"
        except Exception:
            return f"<remote {object.__getattribute__(self, '_name')}>"

    def __str__(self):
        return _checked(self._op("str"), str)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return hash(object.__getattribute__(self, "_id"))


def _checked(value, kind: type):
    if type(value) is not kind:
        raise TypeError(f"the module under test returned {type(value).__name__} where {kind.__name__} is required")
    return value


class _Finder:
    """Last on ``sys.meta_path``: a module nothing else finds, imported by a hidden file, is the agent's."""

    def __init__(self, hidden_root: str) -> None:
        self.hidden_root = hidden_root + os.sep

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        if not self._from_hidden_code() or (path is None and "." in name):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def _from_hidden_code(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        filename = frame.f_code.co_filename if frame is not None else ""
        return filename.startswith(self.hidden_root)

    def create_module(self, spec):
        assert _channel is not None
        try:
            remote = _channel.request({"op": "import", "name": spec.name})
        except ImportError:
            raise
        except Exception as exc:
            raise ImportError(f"the agent's module {spec.name} failed to import: {exc}") from None
        if not isinstance(remote, Remote):
            raise ImportError(f"the agent's module {spec.name} is not a module")
        return _ProxyModule(spec.name, remote)

    def exec_module(self, module) -> None:
        module.__path__ = []


class _ProxyModule(type(sys)):
    def __init__(self, name: str, remote: Remote) -> None:
        super().__init__(name)
        self.__remote = remote

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self.__remote, name)
        except Exception as exc:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} ({exc})") from None


# ---- the run -------------------------------------------------------------------------------------
class _Recorder:
    """pytest plugin: each test phase's outcome, kept in this process's memory."""

    def __init__(self) -> None:
        self.phases: dict[str, list[dict]] = {}
        self.errors: list[str] = []

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.errors.append(report.nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        self.phases.setdefault(report.nodeid, []).append(
            {"when": report.when, "outcome": report.outcome, "xfail": hasattr(report, "wasxfail")})

    def counts(self) -> tuple[list[str], list[str]]:
        passed, failed = [], []
        for nodeid, records in self.phases.items():
            by_phase = {r["when"]: r for r in records}
            call = by_phase.get("call", {})
            ok = (call.get("outcome") == "passed" and not call.get("xfail") and len(records) == len(by_phase)
                  and all(r["outcome"] == "passed" for r in records))
            (passed if ok else failed).append(nodeid)
        return sorted(passed), sorted(failed)


class Judge:
    """One scoring run: hidden files in a private folder, the tests, one report line."""

    def __init__(self, payload: dict) -> None:
        self.payload = payload
        self.start = time.monotonic()
        self.deadline = self.start + float(payload["timeout_s"])
        self.report_fd = os.dup(1)
        self.reported = threading.Lock()
        self.peer_output: collections.deque[bytes] = collections.deque(maxlen=64)
        self.root = _private_folder()
        self.output_path = os.path.join(self.root, "output.txt")

    def prepare(self) -> None:
        for path, text in self.payload["files"].items():
            target = os.path.join(self.root, path)
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
        with open(os.path.join(self.root, "pytest.ini"), "w") as f:
            f.write("[pytest]\n")
        output = os.open(self.output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        write_fd, read_fd, err_fd = self.payload["fds"]
        for fd in (write_fd, read_fd, err_fd):
            try:
                os.fstat(fd)
            except OSError:  # a server that ignored peer_command: no agent's process to talk to
                self.finish({"passed": [], "failed": [], "errors": [], "finished": False, "exitstatus": None},
                            False, infra_error=f"no pipe to the agent's process on fd {fd} (peer_command unsupported?)")
        global _channel
        _channel = Channel(write_fd, read_fd, self.deadline)
        threading.Thread(target=self._drain, args=(err_fd,), daemon=True).start()
        threading.Thread(target=self._watchdog, daemon=True).start()
        sys.meta_path.append(_Finder(self.root))

    def _drain(self, fd: int) -> None:
        while chunk := os.read(fd, 1 << 16):
            self.peer_output.append(chunk[-_OUTPUT_TAIL_BYTES:])

    def _watchdog(self) -> None:
        time.sleep(max(0.0, self.deadline - time.monotonic()))
        self.finish({"passed": [], "failed": [], "errors": [], "finished": False, "exitstatus": None}, True)

    def run_pytest(self) -> dict:
        for name in list(os.environ):
            if name.startswith(("PYTEST_", "PY_COLORS")):
                del os.environ[name]
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        import pytest

        recorder = _Recorder()
        args = [a if a.startswith("-") else os.path.join(self.root, a.strip("/")) for a in self.payload["args"]]
        status = pytest.main(["-c", os.path.join(self.root, "pytest.ini"), "--rootdir", self.root,
                              "--confcutdir", self.root, "-p", "no:cacheprovider", "-p", "no:stepwise", *args],
                             plugins=[recorder])
        passed, failed = recorder.counts()
        return {"passed": passed, "failed": failed, "errors": recorder.errors, "finished": True,
                "exitstatus": int(status)}

    def run_script(self) -> dict:
        import runpy

        script, *args = self.payload["args"]
        sys.argv = [os.path.join(self.root, script), *args]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # the check failed (or the agent's module made it raise)
            import traceback

            traceback.print_exc()
            code = 1
        ok = code == 0
        return {"passed": ["script"] if ok else [], "failed": [] if ok else ["script"], "errors": [],
                "finished": True, "exitstatus": code}

    def finish(self, result: dict, timed_out: bool, infra_error: str | None = None) -> None:
        if not self.reported.acquire(blocking=False):
            return
        with contextlib.suppress(OSError):
            sys.stdout.flush()
            sys.stderr.flush()
        report = {"passed": result["passed"], "failed": result["failed"], "errors": result["errors"],
                  "finished": result["finished"], "worker_exitstatus": result["exitstatus"],
                  "exit_code": result["exitstatus"] if result["exitstatus"] is not None else -9,
                  "timed_out": timed_out, "duration_s": round(time.monotonic() - self.start, 3),
                  "output": self._tail(), "infra_error": infra_error}
        line = f"{REPORT_PREFIX} {self.payload['nonce']} {json.dumps(report)}\n".encode()
        while line:
            line = line[os.write(self.report_fd, line):]
        _remove_tree(self.root)
        os._exit(0)  # no atexit or finalizer of anyone else's runs after the report

    def _tail(self) -> str:
        with open(self.output_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _OUTPUT_TAIL_BYTES))
            text = f.read()
        peer = b"".join(self.peer_output)[-_OUTPUT_TAIL_BYTES // 2:]
        if peer:
            text += b"\n--- output of the module under test ---\n" + peer
        return text.decode("utf-8", errors="replace")


def _private_folder() -> str:
    """A new ``0700`` folder under ``/tmp`` (``tempfile.mkdtemp``'s contract, 64 random bits in the
    name; importing ``tempfile`` and ``shutil`` cost this process about 9 ms of CPU a check)."""
    parent = "/tmp" if os.path.isdir("/tmp") else os.environ.get("TMPDIR") or os.getcwd()
    while True:
        path = os.path.join(parent, f"judge-{os.urandom(8).hex()}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # whatever the umask
        return path


def _remove_tree(root: str) -> None:
    """``shutil.rmtree(root, ignore_errors=True)``: links are removed, never followed, and every name is
    removed relative to its folder's open descriptor (``os.fwalk``), so a folder swapped for a link
    while the walk runs cannot send a removal outside the tree."""
    with contextlib.suppress(OSError, RecursionError):  # a tree too deep to walk stays, as with shutil
        for _, dirs, files, fd in os.fwalk(root, topdown=False):
            for name in files:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
            for name in dirs:
                with contextlib.suppress(OSError):
                    try:
                        os.rmdir(name, dir_fd=fd)
                    except NotADirectoryError:  # a link to a folder: fwalk lists it, never enters it
                        os.unlink(name, dir_fd=fd)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, /proc/PID/mem or /proc/PID/fd for anyone else
    payload = json.loads(sys.stdin.buffer.readline())
    judge = Judge(payload)
    judge.prepare()
    try:
        result = judge.run_script() if payload["kind"] == "script" else judge.run_pytest()
    except BaseException as exc:  # noqa: BLE001 - any failure is a failed run, reported as such
        print(f"judge error: {type(exc).__name__}: {exc}", file=sys.stderr)
        result = {"passed": [], "failed": [], "errors": [f"judge error: {type(exc).__name__}"], "finished": False,
                  "exitstatus": None}
    judge.finish(result, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
