"""`spark-lsp serve --stdio --shared`: the editor's language server process as a tiny stdio bridge
to the user's session host (`spark_lsp.session_host`), which runs every editor's language-server
session in one process with one copy of each model.

What an editor starts is then Python and this module (the standard library only, no pygls,
numpy or engine) while it connects, and a waiting shell afterwards, instead of a full server with
its own tokenizer or engine. The bridge:

1. reads the host's record in the user's runtime directory (the engine daemon's:
   `$SPARK_LSP_RUN_DIR`, else `$XDG_RUNTIME_DIR/spark-lsp`, else `~/.cache/spark-lsp/run`, a
   0700 folder): `lsp-host.json`, mode 0600, with the host's Unix socket, its random token and
   its pid;
2. when no live host is recorded, starts one detached (its own session, so it outlives the
   editor) under a lock file, so two editors starting at once end with one host (the host also
   holds a lock for its lifetime: a second one exits at once);
3. connects to the socket (in the 0700 folder; the host also checks the peer's uid), sends one
   JSON line (the token, and this editor's `--model` / `--engine`), and reads the host's answer;
4. hands the editor's stdin and stdout to the host (`SCM_RIGHTS` over the socket), so the host
   reads and writes the editor's pipes itself, and becomes a waiter: `/bin/sh` blocked on one
   read of the socket (about 1.7 MB resident, 0.4 MB proportional, where a Python process takes
   11 and 6), which exits with the status the host sends when the session ends. Where the
   editor's stdio is not a pipe or a socket (a terminal, a file) the bridge instead copies bytes
   both ways until either side closes, following the LSP framing (not parsing it into objects)
   to see `shutdown` / `exit` go by and to know where a message ends.

If the host goes away while the editor still talks to it, the editor gets a
`window/showMessage` error saying so and the bridge exits with status 1, which editors report
(and restart the server: the new bridge starts a new host). After the editor's `exit` the bridge
exits 0 (1 without a `shutdown` first, as LSP asks).

Only the standard library is imported here: a test checks `sys.modules` of a running bridge.
"""

from __future__ import annotations

import _socket as socket  # `socket` without its enum/selectors layer: 0.7 MB less per bridge
import fcntl
import json
import os
import sys
import threading
import time

# Only what the copying needs is imported (the bridge's memory is the interpreter's own plus a
# little): no argparse, pathlib or typing; subprocess only when a host must be started.

ENV_DIR = "SPARK_LSP_RUN_DIR"  # the same override as engine.service.rundir
ENV_SHARED = (
    "SPARK_LSP_SHARED"  # "1": `serve --stdio` is a bridge (an editor that cannot add flags)
)
#: Why `--shared` found no session host, for the server that the editor then gets instead (its
#: own, as without `--shared`), which says so in the editor once.
ENV_UNSHARED = "SPARK_LSP_UNSHARED"


def install_key(root: str | None = None) -> str:
    """Names this installation of spark-lsp: its interpreter, its folder and the size and time of
    every source file of `spark_lsp` and `engine`. A host serves only bridges of its own
    installation (the record, socket and lock names carry the key), so after an upgrade or an
    edit the next editor starts a host that runs the new code, and the old host exits when its
    own sessions have closed (`--idle-exit`); two virtual environments never share one."""
    import zlib  # not hashlib: it maps OpenSSL's libcrypto, 4 MB more per bridge

    root = root or os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    crc = zlib.crc32(f"{os.path.realpath(sys.executable)}\0{root}".encode())
    stack = [os.path.join(root, "spark_lsp"), os.path.join(root, "engine")]
    while stack:
        try:
            entries = sorted(os.scandir(stack.pop()), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False) and e.name != "__pycache__":
                stack.append(e.path)
            elif e.name.endswith((".py", ".c")):
                st = e.stat()
                crc = zlib.crc32(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(), crc)
    return f"{crc:08x}"


INSTALL = install_key()
RECORD = f"lsp-host-{INSTALL}.json"
START_LOCK = "lsp-host.start.lock"  # held by a bridge while it starts a host
LIFE_LOCK = f"lsp-host-{INSTALL}.lock"  # held by the host for its whole life
SOCKET = f"lsp-host-{INSTALL}.sock"
LOG = "lsp-host.log"
PROTOCOL = 1
#: The waiter a bridge becomes once the host holds the editor's stdio: fd 3 is the socket to the
#: host, which sends the exit status ("0" or "1") when the session ends; if the socket closes
#: without one, the host died: $2 goes to stderr, $1 (an LSP `window/showMessage` frame) to the
#: editor, and the status is 1. POSIX sh, so the bridge costs a shell's memory while it waits.
WAITER = (
    'if IFS= read -r status <&3; then case "$status" in 0|1) exit "$status";; esac; fi; '
    "printf '%s\\n' \"$2\" >&2; printf '%s' \"$1\"; exit 1"
)
SHELL = "/bin/sh"
START_TIMEOUT_S = 60.0
HELLO_TIMEOUT_S = 30.0
CONNECT_TRIES = 4


class BridgeError(RuntimeError):
    """No session host could be reached or started."""


class HostRefused(BridgeError):
    """The host answered the hello with an error (a bad --model, a wrong token)."""


# -- the runtime directory (engine.service.rundir's rules, without importing the engine) ---------
def runtime_dir() -> str:
    """The user's private folder for daemon and host records (created 0700 if missing)."""
    env = os.environ.get(ENV_DIR, "").strip()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if env:
        path = os.path.expanduser(env)
    elif runtime and os.path.isdir(runtime):
        path = os.path.join(runtime, "spark-lsp")
    else:
        path = os.path.join(os.path.expanduser("~"), ".cache", "spark-lsp", "run")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def read_record(folder: str | None = None) -> dict | None:
    """The record of a live session host, else None."""
    try:
        with open(os.path.join(folder or runtime_dir(), RECORD)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("pid"), int)
        or not isinstance(data.get("socket"), str)
        or not isinstance(data.get("token"), str)
    ):
        return None
    return data if pid_alive(data["pid"]) else None


# -- finding or starting the host ----------------------------------------------------------------
def host_command() -> list[str]:
    return [sys.executable, "-m", "spark_lsp.session_host"]


def start_host(folder: str, timeout_s: float = START_TIMEOUT_S) -> dict:
    """The record of the user's host, starting a detached one if none runs (under a lock file:
    a second bridge waits and then finds the first one's host)."""
    import subprocess

    log_path = os.path.join(folder, LOG)
    with open(os.path.join(folder, START_LOCK), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read_record(folder)
        if found is not None:
            return found
        env = dict(os.environ)
        # this spark_lsp must import in the host
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # every session's engine thread would otherwise get its own malloc arena (~3 MB each
        # kept after its runs); two suffice for a handful of threads taking turns on the engine
        env.setdefault("MALLOC_ARENA_MAX", "2")
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(
                host_command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=env,
                close_fds=True,
                cwd="/",
            )
        finally:
            log.close()
        # reap it when it exits, so a dead host is not a zombie that looks alive
        threading.Thread(target=proc.wait, name="spark-host-reaper", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = read_record(folder)
            if found is not None:  # ours, or one started by hand meanwhile (ours then exits)
                return found
            if proc.poll() is not None:
                raise BridgeError(
                    f"the session host exited with status {proc.returncode} before serving "
                    f"(log: {log_path})"
                )
            time.sleep(0.02)
        proc.terminate()
        raise BridgeError(f"the session host did not start within {timeout_s:g} s")


def hello(
    record: dict, options: dict, timeout_s: float = HELLO_TIMEOUT_S
) -> tuple[socket.socket, dict]:
    """Connect to the host of `record` and open a session: (the socket, the host's answer).
    `options` {"status": true}: the host answers with its status instead (and closes)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(record["socket"])
        line = {"protocol": PROTOCOL, "token": record["token"], **options}
        sock.sendall(json.dumps(line).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            data = sock.recv(4096)
            if not data:
                raise ConnectionError("the session host closed the connection")
            answer += data
            if len(answer) > 65536:
                raise ConnectionError("the session host's answer is too long")
        reply = json.loads(answer)
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else reply
            raise HostRefused(f"the session host refused the session: {error}")
        sock.settimeout(None)
        return sock, reply
    except BaseException:
        sock.close()
        raise


def host_status(record: dict, timeout_s: float = 3.0) -> dict:
    """What the host of `record` serves (`SessionHost.status`: pid, sessions, shared models);
    BridgeError or OSError where it does not answer."""
    if "since" not in record:  # a host older than the status hello would open a session
        raise BridgeError("an older session host (it answers no status); stop it to update it")
    sock, reply = hello(record, {"status": True}, timeout_s)
    sock.close()
    status = reply.get("status")
    if not isinstance(status, dict):
        raise BridgeError("the session host sent no status (an older host)")
    return status


def clear_stale(folder: str) -> bool:
    """Remove the record of a host that no longer runs although its pid does (the pid was
    reused): no process holds the host's lifetime lock. Under the start lock, so a host a bridge
    is starting (it takes the lifetime lock before it writes its record) is never mistaken."""
    with open(os.path.join(folder, START_LOCK), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fd = os.open(os.path.join(folder, LIFE_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # a host holds it: it runs
            try:
                os.unlink(os.path.join(folder, RECORD))
            except FileNotFoundError:
                pass
            return True
        finally:
            os.close(fd)


def open_session(options: dict) -> tuple[socket.socket, dict]:
    """A session in the user's host (started if none runs): (the socket, the host's answer)."""
    try:
        folder = runtime_dir()
    except OSError as exc:
        raise BridgeError(f"no runtime directory for the session host: {exc}") from None
    problem: Exception | None = None
    for attempt in range(CONNECT_TRIES):
        record = read_record(folder) or start_host(folder)
        try:
            return hello(record, options)
        except HostRefused:
            raise
        except (OSError, ValueError) as exc:  # a host that was just exiting: start another
            problem = exc
            if not isinstance(exc, TimeoutError):
                clear_stale(folder)
            time.sleep(0.05 * (attempt + 1))
    raise BridgeError(f"cannot reach the session host: {problem}")


# -- copying -------------------------------------------------------------------------------------
class Frames:
    """Follows Content-Length framing in a byte stream without holding it: whether the stream is
    between two messages, and the bodies of small messages (`shutdown`, `exit`)."""

    def __init__(self, keep: int = 512) -> None:
        self.keep = keep
        self.head = b""
        self.left = 0  # body bytes still to come; 0: reading a header
        self.body = b""
        self.broken = False  # not LSP framing: no more following

    @property
    def at_boundary(self) -> bool:
        return not self.broken and self.left == 0 and not self.head

    def feed(self, data: bytes) -> list[bytes]:
        out = []
        i = 0
        while i < len(data) and not self.broken:
            if self.left:
                take = data[i : i + self.left]
                i += len(take)
                self.left -= len(take)
                if self.body is not None:
                    self.body += take
                if not self.left and self.body is not None:
                    out.append(self.body)
                continue
            buf = self.head + data[i:]  # a header may arrive in pieces, its end split too
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.head = buf
                if len(buf) > 65536:
                    self.broken = True
                break
            header, i = buf[:end], i + end + 4 - len(self.head)
            self.head = b""
            length = None
            for line in header.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    try:
                        length = int(value)
                    except ValueError:
                        length = None
            if length is None or length < 0:
                self.broken = True
                break
            self.left = length
            self.body = b"" if length <= self.keep else None
            if not length:
                out.append(b"")
        return out


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def pump(sock: socket.socket, stdin: int = 0, stdout: int = 1, host_pid: int | None = None) -> int:
    """Copy the editor's bytes to the host and the host's back until either side closes; the
    bridge's exit status."""
    seen = {"shutdown": False, "exit": False, "eof": False}
    inbound = Frames()

    def editor_to_host() -> None:
        try:
            while True:
                data = os.read(stdin, 65536)
                if not data:
                    seen["eof"] = True
                    break
                for body in inbound.feed(data):
                    method = _method(body)
                    if method in ("shutdown", "exit"):
                        seen[method] = True
                sock.sendall(data)
        except OSError:
            pass
        try:
            sock.shutdown(socket.SHUT_WR)  # the host sees the end of this session
        except OSError:
            pass

    threading.Thread(target=editor_to_host, name="spark-bridge-in", daemon=True).start()
    outbound = Frames(keep=0)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            outbound.feed(data)
            _write_all(stdout, data)
    except BrokenPipeError:  # the editor is gone
        return 0
    except OSError:
        pass
    if seen["exit"]:
        return 0 if seen["shutdown"] else 1
    if seen["eof"]:  # the editor closed its end: as `serve --stdio` then exits
        return 0 if seen["shutdown"] else 1
    # a dying process closes its sockets first
    closed = bool(host_pid) and _outlives(host_pid, 0.3)
    notice, text = host_notice(host_pid, "closed this editor's session" if closed else "stopped")
    print(text, file=sys.stderr, flush=True)
    if outbound.at_boundary:  # never inside a half-written message
        try:
            _write_all(stdout, notice)
        except OSError:
            pass
    return 1


# -- handing the editor's stdio to the host ------------------------------------------------------
def can_hand_off(stdin: int = 0, stdout: int = 1) -> bool:
    """Whether the editor's stdio can be handed to the host: both pipes or sockets (what editors
    spawn servers with), not one socket for both ways, and a POSIX shell to wait in. A terminal
    or a file is copied instead (the host would set it non-blocking under the user's shell)."""
    import stat

    if not hasattr(socket, "SCM_RIGHTS") or not os.access(SHELL, os.X_OK):
        return False
    try:
        a, b = os.fstat(stdin), os.fstat(stdout)
    except OSError:
        return False
    piped = all(stat.S_ISFIFO(x.st_mode) or stat.S_ISSOCK(x.st_mode) for x in (a, b))
    return piped and (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)


def send_stdio(sock: socket.socket, stdin: int = 0, stdout: int = 1) -> None:
    """Send the host our `stdin` and `stdout` (one byte carrying both descriptors)."""
    fds = stdin.to_bytes(4, sys.byteorder) + stdout.to_bytes(4, sys.byteorder)
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])


def host_notice(host_pid: int | None, what: str, folder: str | None = None) -> tuple[bytes, str]:
    """What the editor is told when the host `what` ("stopped", "closed this editor's
    session"): (the `window/showMessage` error as a frame, the line for stderr)."""
    host = "the shared spark-lsp session host" + (f" (pid {host_pid})" if host_pid else "")
    log_path = os.path.join(folder or runtime_dir(), LOG)
    message = f"spark-lsp: {host} {what}; restart the language server (log: {log_path})"
    notice = {"jsonrpc": "2.0", "method": "window/showMessage"}
    return frame({**notice, "params": {"type": 1, "message": message}}), (
        f"spark-lsp serve --shared: {message}"
    )


def death_notice(host_pid: int | None) -> tuple[bytes, str]:
    """What the editor is told if the host dies while the bridge waits."""
    return host_notice(host_pid, "stopped")


def wait_host(sock: socket.socket, host_pid: int | None, stdout: int = 1) -> int:
    """The waiter in Python (where `SHELL` cannot be run): the status the host sends when the
    session ends; if the host dies first, the editor is told and the status is 1."""
    line = b""
    try:
        while not line.endswith(b"\n"):
            data = sock.recv(16)
            if not data:
                break
            line += data
    except OSError:
        pass
    if line in (b"0\n", b"1\n"):  # a whole line, as the shell's `read` takes it
        return int(line)
    notice, text = death_notice(host_pid)
    print(text, file=sys.stderr, flush=True)
    try:
        _write_all(stdout, notice)
    except OSError:
        pass
    return 1


def become_waiter(sock: socket.socket, host_pid: int | None) -> int:
    """Replace this process by the shell waiter (`WAITER`), keeping only the socket (as fd 3),
    the editor's stdout (for the death notice) and stderr; returns only if the shell cannot run."""
    notice, text = death_notice(host_pid)
    try:
        if sock.fileno() != 3:
            os.dup2(sock.fileno(), 3)
        os.set_inheritable(3, True)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the host reads the editor's stdin; the waiter holds no copy of it
        os.close(null)
        os.execv(SHELL, ["sh", "-c", WAITER, "spark-lsp-bridge", notice.decode(), text])
    except OSError:
        pass
    return wait_host(sock, host_pid)


def stop_host(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGTERM the session host `pid` (not our child, so not waitable) and wait up to
    `timeout_s` for it to go; whether it went."""
    import signal

    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    return not _outlives(pid, timeout_s)


def _outlives(pid: int, seconds: float) -> bool:
    """Whether process `pid` is still alive after `seconds`."""
    deadline = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.02)
    return False


def _method(body: bytes) -> str | None:
    try:
        msg = json.loads(body)
    except ValueError:
        return None
    return msg.get("method") if isinstance(msg, dict) else None


def main(model: str | None = None, engine: str | None = None, own_server=None) -> int:
    """Run the bridge for one editor: `model` and `engine` as `serve --model/--engine` take
    them (a model path is made absolute here, where the editor's working directory is known).

    `own_server(why)`: what runs when no session host can be reached or started (a runtime
    directory that cannot be written, a socket path too long, a host that fails to start): the
    editor's own server, as `serve --stdio` without `--shared` (nothing has been read from the
    editor yet), so the editor keeps its suggestions and is told why. A host that refuses the
    session (a bad --model) is not worked around: its error is the one `serve` would give."""
    if model and os.path.exists(os.path.expanduser(model)):
        model = os.path.abspath(os.path.expanduser(model))
    handoff = can_hand_off()
    try:
        sock, reply = open_session({"model": model or None, "engine": engine, "handoff": handoff})
    except BridgeError as exc:
        refused = isinstance(exc, HostRefused)
        fall_back = own_server is not None and not refused
        tail = "; this editor runs its own server" if fall_back else ""
        print(f"spark-lsp serve --shared: {exc}{tail}", file=sys.stderr, flush=True)
        if fall_back:
            return own_server(str(exc))
        return 2 if refused else 1
    try:
        if handoff and reply.get("handoff"):
            try:
                send_stdio(sock)
            except OSError as exc:
                print(f"spark-lsp serve --shared: {exc}", file=sys.stderr, flush=True)
                return 1
            return become_waiter(sock, reply.get("pid"))
        return pump(sock, host_pid=reply.get("pid"))
    finally:
        sock.close()


#: `serve` options the bridge takes: with a value, or a flag (the host logs to lsp-host.log in
#: the runtime directory, so --log-file and --log-level are accepted and left to it).
VALUE_OPTIONS = ("--model", "--engine", "--log-file", "--log-level")
FLAG_OPTIONS = ("--stdio", "--shared")


def parse(argv: list[str]) -> dict[str, str]:
    """`serve` arguments as the bridge takes them ({option: value}); ValueError names a bad one."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in VALUE_OPTIONS:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise ValueError(f"{name} needs a value")
                value = argv[i]
            out[name] = value
        elif arg not in FLAG_OPTIONS:
            raise ValueError(f"{arg}: not an option of `serve --stdio --shared`")
        i += 1
    return out


def argv_main(argv: list[str]) -> int:
    """`serve --stdio --shared` with `argv` (the options after `serve`).

    Run by the `spark-lsp` command, this process has imported the installation's site packages
    (with an editable install, pathlib and an import finder: about 2.5 MB); the bridge needs none
    of them, so it runs itself again as `python -I -S bridge.py` (isolated: no site, no user
    paths, no PYTHON* variables) before reading anything from the editor."""
    try:
        options = parse(argv)
    except ValueError as exc:
        print(f"spark-lsp serve: {exc}", file=sys.stderr)
        return 2
    if not sys.flags.no_site and sys.executable and os.path.isfile(__file__):
        try:
            os.execv(sys.executable, [sys.executable, "-I", "-S", __file__, *argv])
        except OSError:
            pass  # run here, with the site packages loaded
    return main(
        options.get("--model"),
        options.get("--engine"),
        own_server=lambda why: exec_own_server(argv, why),
    )


def exec_own_server(argv: list[str], why: str) -> int:
    """Become `spark-lsp serve` with `argv` but without `--shared` (and without
    $SPARK_LSP_SHARED): the editor's own server, told `why` through $SPARK_LSP_UNSHARED.
    A new interpreter with the site packages (this one has none: see `argv_main`)."""
    env = {k: v for k, v in os.environ.items() if k != ENV_SHARED}
    env[ENV_UNSHARED] = why
    args = [a for a in argv if a != "--shared"]
    try:
        os.execve(sys.executable, [sys.executable, "-m", "spark_lsp.cli", "serve", *args], env)
    except OSError as exc:
        print(f"spark-lsp serve: cannot start the editor's own server: {exc}", file=sys.stderr)
    return 1


def shared_by_env() -> bool:
    """Whether $SPARK_LSP_SHARED asks for the bridge (an editor that cannot add flags)."""
    return os.environ.get(ENV_SHARED, "").strip() in ("1", "true", "yes")


def wants_bridge(argv: list[str]) -> bool:
    """`serve` arguments that ask for the bridge: --shared, or $SPARK_LSP_SHARED=1 with stdio."""
    network = any(a in ("--tcp", "--ws") or a.startswith(("--tcp=", "--ws=")) for a in argv)
    if network:
        return False  # `serve` itself refuses --shared with a network transport
    return "--shared" in argv or shared_by_env()


if __name__ == "__main__":
    sys.exit(argv_main(sys.argv[1:]))
