"""``openbook up``: run the services of docker-compose.yml as local processes.

The compose file stays the single source of truth: this reads each service's ``command``,
``environment``, ``depends_on``, ``healthcheck``, ``restart`` and ``volumes`` and reproduces
them without Docker. Four translations make container settings work on the host:

- service host names (``retriever:8051``, ``redis://redis:6379``) become ``127.0.0.1``;
- the wildcard bind address ``0.0.0.0`` becomes ``127.0.0.1``: inside a container it is the
  container's own network, which ``ports:`` decides what to publish from; on the host it
  would be every interface, so local processes (Redis, the gRPC services) bind loopback;
- container paths of bind mounts (``/var/openbook/indexes``) become the host paths, in a
  shell health check (``CMD-SHELL``) too;
- Redis's port: in the compose network nothing else is on ``redis:6379``, but on the host
  another program may hold 6379 (a Redis of the machine's, anything). With
  ``OPENBOOK_REDIS_PORT`` unset, ``openbook up`` sets it, for the interpolation, to the first
  port that is free or already serves this deployment's Redis (its health check passes),
  trying the port it recorded last time, then compose's default
  (``${OPENBOOK_REDIS_PORT:-6379}``), then the ones after it. Compose's command, health check
  and ``OPENBOOK_REDIS_URL`` all follow that one variable. Once Redis is healthy, the
  endpoint the services were given is recorded in ``<var>/redis-endpoint.json``, where
  services and commands run by hand from this checkout find it (openbook.config.redis_endpoint). A
  port the user sets is taken as it is, as before: a Redis there without this deployment's
  ACL user is refused, never reused.

A service that dies is restarted per its ``restart`` policy after an exponential, capped
delay (``Backoff``), forgotten once it has been healthy for a while, never in a tight loop.

Two compose features decide what runs:

- profiles: a service behind ``profiles`` runs when named, or when one of its profiles is
  active: those ``COMPOSE_PROFILES`` lists (as compose reads it), and the one named after the
  index engine (``OPENBOOK_INDEX_ENGINE=milvus`` turns on ``milvus``, the engine's service).
  A dependency marked ``required: false`` on a service that does not run is skipped, as
  compose skips it;
- ``x-openbook-up`` (:data:`LOCAL_KEY`): a service's keys (``command``, ``healthcheck``,
  ``environment``) replaced when it runs as a local process. The ``milvus`` service's image
  is Milvus standalone; on the host that role is Milvus Lite's own gRPC server
  (``milvus-lite server``), which speaks the same protocol, so the retriever replicas share
  one engine as they share a cluster.

Variables are interpolated as compose does (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``$$``), from this process's environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from openbook.config import redis_endpoint

# Printed once every service is up and healthy; from then on the launcher restarts what dies.
SUPERVISING_LINE = "openbook up: all services started"
WILDCARD_ADDRESS = "0.0.0.0"
LOOPBACK_ADDRESS = "127.0.0.1"
# openbook's Redis: its compose service and the variable of its port.
REDIS_SERVICE = "redis"
REDIS_PORT_VARIABLE = redis_endpoint.PORT_VARIABLE
# How many ports after compose's default are tried: all below the kernel's ephemeral range
# (32768-60999), as the defaults are, so no client socket can hold it while Redis restarts.
REDIS_PORTS_TRIED = 100
# A service's settings for running it as a local process (module docstring).
LOCAL_KEY = "x-openbook-up"
# The variable naming the index engine: the profile of that name is active.
ENGINE_VARIABLE = "OPENBOOK_INDEX_ENGINE"

log = logging.getLogger(__name__)

_VAR = re.compile(
    r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


class LaunchError(RuntimeError):
    pass


def interpolate(value: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        current = env.get(name)
        if op == ":-":
            return current if current else arg
        if op == "-":
            return current if current is not None else arg
        if op in (":?", "?") and (current is None or (op == ":?" and not current)):
            raise LaunchError(f"variable {name} is required: {arg or 'not set'}")
        return current or ""

    return _VAR.sub(replace, value)


def _interpolate_tree(node, env: Mapping[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


def _literal(text: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement that inserts ``text`` as it is (no backslash or group escapes)."""
    return lambda _match: text


def parse_duration(text: str | None, default: float) -> float:
    if not text:
        return default
    total = 0.0
    for amount, unit in _DURATION.findall(str(text)):
        total += float(amount) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total or default


@dataclass
class Backoff:
    """How long to wait before restarting a service that died.

    Exponential and capped, so a service that cannot start (a port taken, a corrupt model)
    is retried ever more slowly instead of in a tight loop that burns the CPU the others need
    and floods the log; forgotten once the service has been healthy for ``reset_after_s``, so
    a crash after days of service is retried at once. Docker's restart policy works the same.
    """

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 30.0
    failures: int = 0

    def next_delay(self) -> float:
        """The delay before the next restart; counts one more failure."""
        delay = min(self.initial_s * self.factor**self.failures, self.max_s)
        self.failures += 1
        return delay

    def should_reset(self, up_for_s: float) -> bool:
        """Whether a service up for ``up_for_s`` seconds may have its failures forgotten
        (once it is also healthy)."""
        return self.failures > 0 and up_for_s >= self.reset_after_s

    def reset(self) -> None:
        self.failures = 0


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    depends_on: dict[str, str] = field(default_factory=dict)
    healthcheck: list[str] | None = None
    health_interval_s: float = 2.0
    health_retries: int = 30
    restart: str = "no"
    external: bool = False  # a third-party image (e.g. redis): reuse one already running
    profiles: list[str] = field(default_factory=list)
    # dependencies marked ``required: false``: skipped when they do not run (a profile off)
    optional: set[str] = field(default_factory=set)


class ComposeProject:
    """The services of a compose file, translated for running on this host."""

    def __init__(self, compose_file: Path, env: Mapping[str, str] | None = None) -> None:
        self.file = Path(compose_file).resolve()
        if not self.file.is_file():
            raise LaunchError(f"{self.file}: no such compose file")
        self.base_dir = self.file.parent
        self.env = dict(os.environ if env is None else env)
        raw = yaml.safe_load(self.file.read_text())
        doc = _interpolate_tree(raw, self.env)
        self.services: dict[str, ServiceSpec] = {}
        names = list(doc.get("services", {}))
        self._host_names = names
        for name, svc in doc.get("services", {}).items():
            local = svc.get(LOCAL_KEY) or {}
            if local:
                svc = {**svc, **local, "environment": _merged_env(svc, local)}
            self.services[name] = self._spec(name, svc)
        self.profiles = active_profiles(self.env)

    def _mounts(self, svc: dict) -> list[tuple[str, str]]:
        """(container path, host path) for every volume of ``svc``.

        Bind mounts (``./x``, ``/x``, ``~/x``) map to their host folder, as in compose; named
        volumes map to ``<compose dir>/var/volumes/<name>``, so no container path is ever used
        on the host as it is.
        """
        mounts = []
        for volume in svc.get("volumes", []) or []:
            if isinstance(volume, str):
                source, target = volume.split(":")[:2]
            else:
                source, target = volume.get("source", ""), volume["target"]
            if source.startswith((".", "/", "~")):
                host = (self.base_dir / Path(source).expanduser()).resolve()
            elif re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", source):
                host = self.base_dir / "var" / "volumes" / source
            else:
                raise LaunchError(
                    f"volume {source!r}: not a valid volume name; a relative host path must "
                    "start with ./ (as in compose)"
                )
            mounts.append((target.rstrip("/"), str(host)))
        # Longest container path first, so /a/b wins over /a.
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def translate(self, value: str, mounts: list[tuple[str, str]]) -> str:
        if value == WILDCARD_ADDRESS:
            return LOOPBACK_ADDRESS
        for target, host in mounts:
            if value == target or value.startswith(target + "/"):
                return host + value[len(target) :]
        for name in self._host_names:
            # Only host-shaped uses (``name:port``, ``//name/``) so a bare word is left alone.
            value = re.sub(
                rf"(^|//|@){re.escape(name)}(?=:\d|/)", rf"\g<1>{LOOPBACK_ADDRESS}", value
            )
        return value

    @staticmethod
    def translate_shell(command: str, mounts: list[tuple[str, str]]) -> str:
        """``command`` (a ``sh -c`` string) with every container mount path in it, as a whole
        path component, replaced by its host path (quoted for the shell where needed)."""
        for target, host in mounts:
            command = re.sub(
                rf"(?<![\w./-]){re.escape(target)}(?=/|\s|$|[;|&<>)])",
                _literal(shlex.quote(host)),
                command,
            )
        return command

    def _spec(self, name: str, svc: dict) -> ServiceSpec:
        mounts = self._mounts(svc)
        command = svc.get("command")
        if command is None:
            raise LaunchError(f"service {name}: no command (openbook up needs one to run it)")
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        argv = [self.translate(arg, mounts) for arg in argv]
        environment = svc.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env = {
            k: self.translate("" if v is None else str(v), mounts) for k, v in environment.items()
        }
        for _, host in mounts:
            if not Path(host).exists():  # a bound file (a config) is there already
                Path(host).mkdir(parents=True, exist_ok=True)
        depends = svc.get("depends_on") or {}
        optional: set[str] = set()
        if isinstance(depends, list):
            depends = {d: "service_started" for d in depends}
        else:
            optional = {d for d, c in depends.items() if (c or {}).get("required") is False}
            depends = {d: (c or {}).get("condition", "service_started") for d, c in depends.items()}
        health = svc.get("healthcheck") or {}
        test = health.get("test")
        if isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
            test = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
        elif isinstance(test, str):
            test = ["sh", "-c", test]
        if test and test[:2] == ["sh", "-c"]:
            test = ["sh", "-c", self.translate_shell(test[2], mounts)]
        elif test:
            test = [self.translate(arg, mounts) for arg in test]
        return ServiceSpec(
            name=name,
            argv=argv,
            env=env,
            depends_on=depends,
            healthcheck=test or None,
            health_interval_s=parse_duration(health.get("interval"), 2.0),
            health_retries=int(health.get("retries", 30)),
            restart=str(svc.get("restart", "no")),
            external="build" not in svc,
            profiles=list(svc.get("profiles", [])),
            optional=optional,
        )

    def enabled(self, name: str) -> bool:
        """Whether service ``name`` runs without being named: no profile, or an active one."""
        profiles = self.services[name].profiles
        return not profiles or bool(self.profiles & set(profiles))

    def resolve_order(self, wanted: list[str] | None) -> list[str]:
        """Services to start, dependencies first (profiled ones only when named)."""
        if wanted:
            unknown = [w for w in wanted if w not in self.services]
            if unknown:
                raise LaunchError(f"unknown service(s): {', '.join(unknown)}")
            roots = wanted
        else:
            roots = [n for n in self.services if self.enabled(n)]
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in order:
                return
            if name in visiting:
                raise LaunchError(f"dependency cycle through {name}")
            visiting.add(name)
            spec = self.services[name]
            for dep in spec.depends_on:
                if dep not in self.services:
                    raise LaunchError(f"{name} depends on unknown service {dep}")
                if dep in spec.optional and not self.enabled(dep) and dep not in (wanted or []):
                    continue  # required: false, and its profile is off: compose skips it too
                visit(dep)
            visiting.discard(name)
            order.append(name)

        for root in roots:
            visit(root)
        return order


def _merged_env(svc: dict, local: dict) -> dict:
    """A service's environment with its local (``x-openbook-up``) one over it."""

    def as_dict(environment: object) -> dict:
        if isinstance(environment, list):
            return dict(item.split("=", 1) for item in environment)
        return dict(environment or {})  # type: ignore[call-overload]

    return {**as_dict(svc.get("environment")), **as_dict(local.get("environment"))}


def active_profiles(env: Mapping[str, str]) -> set[str]:
    """The profiles that are on: ``COMPOSE_PROFILES`` (comma-separated, as compose reads
    it) and the one named after the index engine (``OPENBOOK_INDEX_ENGINE``)."""
    profiles = {p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    engine = env.get(ENGINE_VARIABLE, "").strip()
    return profiles | ({engine} if engine else set())


# Commands installed with openbook (its own, and ``milvus-lite`` of its retriever) are found
# beside this Python when its folder is not on PATH (an unactivated virtual environment).
_INSTALLED_WITH_OPENBOOK = ("openbook", "milvus-lite")


def _resolve(argv: list[str], env: Mapping[str, str], service: str) -> list[str]:
    """Find the executable; openbook's own commands (``openbook``, ``openbook-retriever``,
    ``openbook-health``, ...) and ``milvus-lite`` fall back to the ones beside this Python."""
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None and argv[0].startswith(_INSTALLED_WITH_OPENBOOK) and "/" not in argv[0]:
        sibling = Path(sys.executable).parent / argv[0]
        exe = str(sibling) if sibling.exists() else None
    if exe is None:
        raise LaunchError(f"service {service}: command {argv[0]!r} not found on PATH")
    return [exe, *argv[1:]]


class _Process:
    def __init__(
        self,
        spec: ServiceSpec,
        base_env: Mapping[str, str],
        cwd: Path,
        backoff: Backoff | None = None,
    ) -> None:
        self.spec = spec
        self.env = {**base_env, **spec.env}
        self.cwd = cwd
        self.popen: subprocess.Popen | None = None
        self.stopping = False
        self.backoff = backoff or Backoff()
        self.started_at = 0.0  # time.monotonic() of the last start
        self.restart_at: float | None = None  # when a dead service is due to be restarted
        self.next_stability_check = 0.0  # health checks for a backoff reset, rate-limited

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.popen = subprocess.Popen(
            _resolve(self.spec.argv, self.env, self.spec.name),
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our signal handling stops it, not the terminal's ^C
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._pump, args=(self.popen,), daemon=True).start()

    def _pump(self, popen: subprocess.Popen) -> None:
        prefix = f"{self.spec.name:>10} | "
        assert popen.stdout is not None
        for line in popen.stdout:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()

    def healthy(self) -> bool:
        if not self.spec.healthcheck:
            return True
        try:
            return (
                subprocess.run(
                    _resolve(self.spec.healthcheck, self.env, self.spec.name),
                    env=self.env,
                    cwd=self.cwd,
                    capture_output=True,
                    timeout=30,
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired, LaunchError):
            return False

    def stop(self, grace_s: float = 15.0) -> None:
        self.stopping = True
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


class Stack:
    """Start services in dependency order, keep them running (restart policy), stop them all."""

    def __init__(
        self,
        project: ComposeProject,
        services: list[str] | None = None,
        backoff: Backoff | None = None,
        poll_s: float = 0.5,
        on_healthy: Callable[[str], None] | None = None,
    ) -> None:
        """``backoff`` is the restart policy every service gets a copy of; ``poll_s`` how
        often the supervisor looks at the processes; ``on_healthy(name)`` is called when a
        service is found healthy at start (started by us or reused)."""
        self.project = project
        self.order = project.resolve_order(services)
        self.processes: dict[str, _Process] = {}
        self.backoff = backoff or Backoff()
        self.poll_s = poll_s
        self.on_healthy = on_healthy or (lambda _name: None)
        self._stop = threading.Event()

    def _wait_condition(self, name: str, condition: str) -> None:
        proc = self.processes.get(name)
        if proc is None:
            return
        if condition == "service_completed_successfully":
            code = proc.popen.wait() if proc.popen else 0
            if code != 0:
                raise LaunchError(f"{name} exited with status {code}")
        elif condition == "service_healthy":
            self._wait_healthy(proc)

    def _wait_healthy(self, proc: _Process) -> None:
        spec = proc.spec
        deadline = time.monotonic() + max(spec.health_interval_s * spec.health_retries, 30)
        while not self._stop.is_set():
            if proc.popen is not None and proc.popen.poll() is not None:
                hint = ""
                if spec.external and spec.healthcheck:
                    # Its health check failed before we started it, and now it cannot start:
                    # usually one already running on its port that the check refuses (a Redis
                    # without this deployment's password is not reused).
                    hint = (
                        f" (is another {spec.name} already running on its port? one that fails"
                        " its health check, e.g. a Redis without this deployment's ACL user"
                        " and password, is never reused: stop it"
                        + (
                            f", or leave {REDIS_PORT_VARIABLE} unset: openbook up then takes a"
                            " free port)"
                            if spec.name == REDIS_SERVICE
                            else ")"
                        )
                    )
                raise LaunchError(f"{spec.name} exited with status {proc.popen.returncode}{hint}")
            if proc.healthy():
                print(f"openbook up: {spec.name} is healthy", flush=True)
                self.on_healthy(spec.name)
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{spec.name} not healthy in time")
            self._stop.wait(min(spec.health_interval_s, 1.0))
        raise LaunchError("stopped")

    def start(self) -> None:
        for name in self.order:
            spec = self.project.services[name]
            for dep, condition in spec.depends_on.items():
                self._wait_condition(dep, condition)
            proc = _Process(
                spec, self.project.env, self.project.base_dir, dataclasses.replace(self.backoff)
            )
            if spec.external and spec.healthcheck and proc.healthy():
                print(f"openbook up: {name} already running, reusing it", flush=True)
                self.on_healthy(name)
                continue
            print(f"openbook up: starting {name}: {shlex.join(spec.argv)}", flush=True)
            proc.start()
            self.processes[name] = proc
        for name in self.order:  # report readiness of the services nothing waited on
            started = self.processes.get(name)
            if started and started.spec.healthcheck and started.spec.restart != "no":
                self._wait_healthy(started)
        print(SUPERVISING_LINE, flush=True)

    def supervise(self) -> None:
        """Restart services per their restart policy until ``stop``; fail if one dies for good.

        A dead service is restarted after its backoff delay; the loop never sleeps through
        it, so one service waiting does not hold up the others (or ``stop``).
        """
        while not self._stop.wait(self.poll_s):
            for name, proc in self.processes.items():
                if proc.stopping:
                    continue
                code = proc.popen.poll() if proc.popen else None
                now = time.monotonic()
                if code is None:
                    self._forget_failures_once_stable(name, proc, now)
                elif proc.restart_at is not None:
                    if now >= proc.restart_at:
                        print(f"openbook up: restarting {name}", flush=True)
                        proc.start()
                elif self._restarts(proc.spec.restart, code):
                    delay = proc.backoff.next_delay()
                    proc.restart_at = now + delay
                    print(
                        f"openbook up: {name} exited ({code}), restarting in {delay:.1f}s "
                        f"(failure {proc.backoff.failures})",
                        flush=True,
                    )
                elif proc.spec.restart == "no" and code != 0 and not self._is_job(name):
                    raise LaunchError(f"{name} exited with status {code}")

    @staticmethod
    def _restarts(policy: str, code: int) -> bool:
        return policy in ("always", "unless-stopped") or (policy == "on-failure" and code != 0)

    def _forget_failures_once_stable(self, name: str, proc: _Process, now: float) -> None:
        # Up long enough *and* healthy: a service that stays up but never gets healthy keeps
        # its backoff. The health check (a process) runs only when there are failures to
        # forget, and at most once per health interval.
        if not proc.backoff.should_reset(now - proc.started_at) or now < proc.next_stability_check:
            return
        proc.next_stability_check = now + proc.spec.health_interval_s
        if proc.healthy():
            print(f"openbook up: {name} healthy again, restart backoff reset", flush=True)
            proc.backoff.reset()

    def _is_job(self, name: str) -> bool:
        return any(
            spec.depends_on.get(name) == "service_completed_successfully"
            for spec in self.project.services.values()
        )

    def stop(self) -> None:
        self._stop.set()
        for name in reversed(list(self.processes)):
            self.processes[name].stop()


def _port_free(port: int) -> bool:
    """Whether a server could listen on loopback ``port`` now (SO_REUSEADDR, as Redis binds:
    a connection of its last run in TIME_WAIT does not hold the port)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK_ADDRESS, port))
        except OSError:
            return False
    return True


@dataclass
class LocalRedis:
    """openbook's own Redis under ``openbook up``: its port and where its endpoint is recorded."""

    port: int
    chosen: bool  # by the launcher; False: the user's OPENBOOK_REDIS_PORT, taken as it is
    record: Path

    @classmethod
    def plan(cls, compose_file: Path, env: dict[str, str]) -> LocalRedis | None:
        """Redis's port, set into ``env`` (the interpolation's) unless the user set it: the
        first of the recorded port, compose's default and the ones after it that is free or
        already serves this deployment's Redis. None when the compose file runs no Redis
        whose port ``OPENBOOK_REDIS_PORT`` sets (nothing to choose or record)."""
        path = Path(compose_file).resolve()
        if not path.is_file():
            return None  # ComposeProject says so
        text = path.read_text()
        default = re.search(r"\$\{" + REDIS_PORT_VARIABLE + r":?-(\d+)\}", text)
        services = (yaml.safe_load(text) or {}).get("services") or {}
        if default is None or REDIS_SERVICE not in services:
            return None
        var = path.parent / Path(interpolate("${OPENBOOK_VAR_DIR:-./var}", env)).expanduser()
        record = redis_endpoint.record_path(var.resolve())
        if env.get(REDIS_PORT_VARIABLE):
            try:
                return cls(int(env[REDIS_PORT_VARIABLE]), chosen=False, record=record)
            except ValueError:
                raise LaunchError(
                    f"{REDIS_PORT_VARIABLE}={env[REDIS_PORT_VARIABLE]!r}: not a port number"
                ) from None
        try:
            recorded = redis_endpoint.read_record(record)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        first = int(default.group(1))
        candidates = list(range(first, first + REDIS_PORTS_TRIED))
        recorded_port = redis_endpoint.port_of(recorded.url) if recorded else None
        if recorded_port is not None:
            candidates.insert(0, recorded_port)
        taken: list[int] = []
        for port in dict.fromkeys(candidates):
            trial = {**env, REDIS_PORT_VARIABLE: str(port)}
            if _port_free(port) or _serves_this_redis(path, trial):
                env.update(trial)
                if taken:
                    print(
                        f"openbook up: port(s) {', '.join(map(str, taken))} held by another "
                        f"program (not this deployment's Redis, left alone): openbook's Redis "
                        f"takes {LOOPBACK_ADDRESS}:{port}",
                        flush=True,
                    )
                return cls(port, chosen=True, record=record)
            taken.append(port)
        raise LaunchError(
            f"no port for Redis: {first}-{first + REDIS_PORTS_TRIED - 1} are all held by other "
            f"programs; set {REDIS_PORT_VARIABLE} to a free port"
        )

    def write_record(self, project: ComposeProject) -> None:
        """Record how the stack's services reach Redis (their translated OPENBOOK_REDIS_*
        and server key settings), for services and commands run by hand."""
        for spec in project.services.values():
            env = spec.env
            if env.get(redis_endpoint.URL_VARIABLE):
                endpoint = redis_endpoint.RedisEndpoint(
                    url=env[redis_endpoint.URL_VARIABLE],
                    username=env.get("OPENBOOK_REDIS_USERNAME") or None,
                    password_file=env.get("OPENBOOK_REDIS_PASSWORD_FILE") or None,
                    server_key_file=env.get("OPENBOOK_SERVER_KEY_FILE") or None,
                    tls_ca_file=env.get("OPENBOOK_REDIS_TLS_CA_FILE") or None,
                )
                redis_endpoint.write_record(self.record, endpoint)
                print(
                    f"openbook up: Redis at {redis_endpoint.redacted(endpoint.url)}, recorded "
                    f"in {self.record} for commands run here",
                    flush=True,
                )
                return


def _serves_this_redis(compose_file: Path, env: Mapping[str, str]) -> bool:
    """Whether the Redis compose describes with ``env`` is running: its health check passes
    (this deployment's ACL user and password get in), as `openbook up` reuses one."""
    project = ComposeProject(compose_file, env)
    spec = project.services[REDIS_SERVICE]
    if not spec.healthcheck:
        return False  # nothing tells ours from another
    return _Process(spec, project.env, project.base_dir).healthy()


def access_line(env: Mapping[str, str]) -> str:
    """The line saying whether the gateway asks every route for a key."""
    closed = env.get("OPENBOOK_GATEWAY_REQUIRE_KEYS", "").strip().lower() in ("1", "true", "on")
    if closed:
        return "openbook up: gateway requires keys (all but health, metrics and the page)"
    return "openbook up: gateway open: no key needed to ask (OPENBOOK_GATEWAY_REQUIRE_KEYS=false)"


def local_stack(
    compose_file: Path, services: list[str] | None = None, env: Mapping[str, str] | None = None
) -> Stack:
    """The stack `openbook up` runs: Redis's port chosen where the user did not choose it
    (``LocalRedis.plan``), its endpoint recorded once it is healthy."""
    environment = dict(os.environ if env is None else env)
    local_redis = LocalRedis.plan(Path(compose_file), environment)
    project = ComposeProject(compose_file, environment)

    def on_healthy(name: str) -> None:
        if local_redis is not None and name == REDIS_SERVICE:
            local_redis.write_record(project)
        if name == "gateway":  # which door it has (issue 43)
            print(access_line({**environment, **project.services[name].env}), flush=True)

    return Stack(project, services, on_healthy=on_healthy)


def run_stack(compose_file: Path, services: list[str] | None = None) -> None:
    stack = local_stack(compose_file, services)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stack._stop.set())
    try:
        stack.start()
        stack.supervise()
    finally:
        stack.stop()
