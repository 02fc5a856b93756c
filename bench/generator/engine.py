"""The default generator service, this tree against a baseline commit: latency and throughput.

    .venv/bin/python bench/generator/engine.py            # 1/4/8/16 clients, ~15 min on 2 CPUs
    .venv/bin/python bench/generator/engine.py --quick    # 1 and 4 clients, a few requests

Two ``openbook-generator`` processes from the same virtualenv, the same machine, the same run:

* **baseline**: the code of ``--baseline-ref`` (default a390178, the generator-engine issue's
  starting commit), from a git worktree at ``--baseline-tree`` (created when missing, reused when
  it is at that commit);
* **current**: this working tree, uncommitted changes included.

Each runs as ``python -m openbook_generator`` with its tree first on the import path:
``PYTHONPATH=<tree>:<tree>/services/generator`` and the tree as working directory, which shadow
the virtualenv's editable installs (their finders come after the path entries). Before starting
the servers the script imports ``openbook_generator.server`` that way in a subprocess and checks
that every ``openbook*`` module came from the tree (that also generates the tree's gRPC stubs).

Both get the same model directory (``--model``, default ``<var>/models/gemma-3-270m``), free
ports, a private redis-server (when installed; db 0 and 1) and otherwise their own defaults:
no ``OPENBOOK_*`` variable of the caller is passed on, and the latest trained checkpoint is not
loaded (``OPENBOOK_GENERATOR_LOAD_LATEST_CHECKPOINT=false``), so both serve ``--model``. Both
servers stay up for the whole run, started one after the other (one model load at a time).

Requests are "/answer-sized": a SQuAD question of the demo data with its top-``--k`` (5) passages
(at most 100 words each) from the default demo index (``<var>/indexes/wiki-2018``), retrieved once
and cached in ``<var>/bench/generator-engine-requests.json`` so both trees get identical requests;
``DecodingOptions`` are left unset, so each service's defaults apply (greedy RAG-Token).

Levels (``--clients``): with 1 client, ``--requests-1`` sequential requests give p50/p99 latency;
with c clients, c threads send requests back to back for ``--seconds`` (or
``--requests-per-client`` each) and give answers/s (answers / wall time until the last one
returns), p50/p99 and errors (any non-OK gRPC status). Fairness: the totals per tree and level are
split over ``--rounds`` rounds; round r measures every level on baseline then current (odd rounds:
current then baseline), so slow drift of the machine's load hits both alike. Before a tree's first
measurement at a level, one unmeasured warm-up burst of c requests.

Output: machine info and one markdown table row per level (baseline and current p50, p99,
answers/s; p50 ratio = baseline / current, throughput ratio = current / baseline; "same answers":
requests both trees answered, and how many of those got the same text); per level, the
throughput ratio of each round and their geometric mean with its 95% interval (Student's t over
the rounds: each round measures both trees back to back, a paired sample), ``--json``.
Server logs: ``<var>/bench/generator-engine/``. ``--current-tree`` measures another checkout as
"current"; ``--only`` one tree alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from openbook.index.request import SearchRequest

# The private redis-server and free ports come from the test kit (tests/openbook_testkit).
from openbook_testkit.stack import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REF = "a390178"
DEFAULT_TREE = Path("/work/openbook-baseline")

# Run inside a tree's server environment: import the server module, then report where every
# openbook* module came from.
PROBE = """
import json, sys
import openbook.v1.generator_pb2, openbook_generator.server, openbook_generator.__main__
mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
        if n.split(".")[0].startswith("openbook")}
print(json.dumps(mods))
"""


# ---------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The default generator service: this working tree against a baseline commit "
        "(p50/p99 latency, answers/s at 1/4/8/16 concurrent /answer-sized requests)."
    )
    p.add_argument("--baseline-ref", default=DEFAULT_REF, help="default %(default)s")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=DEFAULT_TREE,
        help="git worktree of the baseline (created if missing; default %(default)s)",
    )
    p.add_argument(
        "--current-tree",
        type=Path,
        default=ROOT,
        help="the tree measured as current (default: this working tree, %(default)s)",
    )
    p.add_argument("--var", type=Path, default=ROOT / "var", help="default: the repo's var/")
    p.add_argument(
        "--data", type=Path, default=ROOT / "data", help="demo data (default: the repo's data/)"
    )
    p.add_argument("--model", type=Path, help="default <var>/models/gemma-3-270m")
    p.add_argument(
        "--index",
        default="wiki-2018",
        help="index name under <var>/indexes, or a path; 'gold': the gold SQuAD paragraph and "
        "k-1 random ones instead of retrieval (default %(default)s)",
    )
    p.add_argument("--k", type=int, default=5, help="passages per request (default 5)")
    p.add_argument("--questions", type=int, default=64, help="request list size (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clients",
        default="1,4,8,16",
        help="concurrency levels, comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--requests-1",
        type=int,
        default=12,
        help="sequential requests per tree at 1 client (default 12)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="seconds per tree and level with >1 client, split over the rounds (default 60)",
    )
    p.add_argument(
        "--requests-per-client",
        type=int,
        help="instead of --seconds: requests per client per tree and level (split over rounds)",
    )
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument(
        "--current-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the current tree's server only (repeatable), e.g. "
        "OPENBOOK_GENERATOR_PASSAGE_CACHE_MB=0",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for both servers (repeatable), e.g. OPENBOOK_GENERATOR_DTYPE=float32; "
        "--current-env overrides it for the current one",
    )
    p.add_argument(
        "--only",
        choices=("both", "baseline", "current"),
        default="both",
        help="measure one tree only (default both)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per server")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--quick", action="store_true", help="1 and 4 clients, a few requests")
    args = p.parse_args(argv)
    if args.quick:
        args.clients = "1,4"
        args.requests_1 = 4
        args.requests_per_client = 2
    args.levels = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    if not args.levels or min(args.levels) < 1:
        p.error("--clients: positive integers")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.var = args.var.resolve()
    args.model = (args.model or args.var / "models" / "gemma-3-270m").resolve()
    return args


# ---------------------------------------------------------------------------------------------
# the baseline tree


def git(*cmd: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *cmd], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def ensure_baseline_tree(tree: Path, ref: str) -> str:
    """The worktree of ``ref`` at ``tree`` (created if missing); returns its commit."""
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    if not tree.exists():
        print(f"creating worktree {tree} at {ref} ({commit[:9]})", file=sys.stderr)
        git("worktree", "add", "--detach", str(tree), commit)
    head = git("rev-parse", "HEAD", cwd=tree)
    if head != commit:
        sys.exit(
            f"{tree} is at {head[:9]}, not {ref} ({commit[:9]}): remove it or pass another "
            "--baseline-tree"
        )
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    if dirty:
        print(f"warning: {tree} has local changes:\n{dirty}", file=sys.stderr)
    return commit


# ---------------------------------------------------------------------------------------------
# servers


def tree_env(tree: Path) -> dict[str, str]:
    """The caller's environment without OPENBOOK_*, the tree first on the import path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBOOK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "services" / "generator")])
    env.pop("PYTHONSTARTUP", None)
    return env


def verify_imports(name: str, tree: Path) -> dict[str, str]:
    """Import the server in ``tree``'s environment; every openbook* module must be the tree's."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        sys.exit(f"{name}: importing the server from {tree} failed:\n{out.stderr[-3000:]}")
    mods = json.loads(out.stdout.strip().splitlines()[-1])
    foreign = {n: f for n, f in mods.items() if f and not Path(f).resolve().is_relative_to(tree)}
    if foreign:
        sys.exit(f"{name}: modules not from {tree}: {foreign}")
    return {n: mods[n] for n in ("openbook", "openbook_generator") if n in mods}


@dataclass
class Server:
    name: str
    tree: Path
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, args: argparse.Namespace, redis_url: str | None, workdir: Path) -> None:
        env = tree_env(self.tree)
        env.update(
            OPENBOOK_GENERATOR_PORT=str(self.port),
            OPENBOOK_GENERATOR_METRICS_PORT=str(free_port()),
            OPENBOOK_GENERATOR_MODEL=str(args.model),
            OPENBOOK_GENERATOR_LOAD_LATEST_CHECKPOINT="false",
            # an empty checkpoint root: nothing to follow or reload
            OPENBOOK_CHECKPOINT_DIR=str(workdir / f"checkpoints-{self.name}"),
        )
        if redis_url:
            env["OPENBOOK_REDIS_URL"] = redis_url
        env.update(item.split("=", 1) for item in args.env)
        if self.name == "current":
            env.update(item.split("=", 1) for item in args.current_env)
        self.log_file = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openbook_generator"],
            cwd=self.tree,
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from openbook.v1 import generator_pb2, generator_pb2_grpc

        t0 = time.monotonic()
        with grpc.insecure_channel(self.addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    sys.exit(
                        f"{self.name} server exited ({self.proc.returncode}):\n{self.log_tail()}"
                    )
                if time.monotonic() - t0 > timeout_s:
                    sys.exit(
                        f"{self.name} server not ready after {timeout_s:.0f}s:\n{self.log_tail()}"
                    )
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        info = generator_pb2_grpc.GeneratorStub(channel).Info(
                            generator_pb2.InfoRequest(), timeout=10
                        )
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        self.info = {
            "model_version": info.model_version,
            "model_type": info.model_type,
            "device": info.device,
            "dtype": info.dtype,
            "load_s": round(time.monotonic() - t0, 1),
        }

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log_file", None):
            self.log_file.close()


# ---------------------------------------------------------------------------------------------
# requests


def load_requests(args: argparse.Namespace) -> list[dict]:
    """The fixed request list: cached so both trees (and later runs) get identical requests."""
    cache = args.var / "bench" / "generator-engine-requests.json"
    key = {"index": str(args.index), "k": args.k, "questions": args.questions, "seed": args.seed}
    if cache.exists():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return data["requests"]
    items = squad_items(args.data, args.questions, args.seed)
    questions = [it.question for it in items]
    if args.index == "gold":
        requests = gold_requests(items, args.k, args.seed)
    else:
        from openbook.index import open_index

        path = Path(args.index) if "/" in args.index else args.var / "indexes" / args.index
        if not (path / "manifest.json").exists():
            sys.exit(
                f"no index at {path}: build the demo indexes (openbook-trainer demo "
                "prepare) or pass --index gold"
            )
        print(
            f"retrieving top-{args.k} passages for {len(questions)} questions from {path}",
            file=sys.stderr,
        )
        with open_index(path, verify=False) as idx:
            hits = idx.search(SearchRequest(questions, k=args.k))
        requests = [
            {
                "question": q,
                "passages": [
                    {"id": p.id, "title": p.title, "text": p.text, "score": float(p.score)}
                    for p in ps
                ],
            }
            for q, ps in zip(questions, hits, strict=True)
        ]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "requests": requests}, indent=1))
    return requests


@dataclass(frozen=True)
class Item:
    title: str
    text: str
    question: str


def squad_items(data_dir: Path, n: int, seed: int) -> list[Item]:
    """``n`` questions drawn with ``seed`` from the demo SQuAD data, with their paragraphs: the
    draw of openbook_trainer.demo.check_prompt.squad_items, read here without importing the
    trainer (which imports openbook.rag, the code under test)."""

    def rows(name: str) -> list[dict]:
        path = data_dir / "squad" / name
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    paragraphs = {p["id"]: p for p in rows("paragraphs.jsonl")}
    questions = rows("questions.jsonl")
    chosen = random.Random(seed).sample(questions, min(n, len(questions)))
    return [
        Item(paragraphs[q["paragraph"]]["title"], paragraphs[q["paragraph"]]["text"], q["question"])
        for q in chosen
    ]


def gold_requests(items: list, k: int, seed: int) -> list[dict]:
    """The gold paragraph first (score 1), then k-1 other items' paragraphs (score 0)."""
    rng = random.Random(seed)

    def cut(text: str) -> str:
        return " ".join(text.split()[:100])

    out = []
    for i, it in enumerate(items):
        others = rng.sample([j for j in range(len(items)) if j != i], k - 1)
        passages = [{"id": f"gold-{i}", "title": it.title, "text": cut(it.text), "score": 1.0}]
        passages += [
            {"id": f"other-{j}", "title": items[j].title, "text": cut(items[j].text), "score": 0.0}
            for j in others
        ]
        out.append({"question": it.question, "passages": passages})
    return out


def to_protos(requests: list[dict]) -> list:
    from openbook.v1 import common_pb2, generator_pb2

    return [
        generator_pb2.GenerateRequest(
            question=r["question"],
            passages=[common_pb2.Passage(**p) for p in r["passages"]],
            # options unset: the service's default decoding
        )
        for r in requests
    ]


# ---------------------------------------------------------------------------------------------
# measuring


@dataclass
class Sample:
    latencies: list[float] = field(default_factory=list)  # seconds, OK answers only
    answers: int = 0
    errors: list[str] = field(default_factory=list)
    busy_s: float = 0.0  # wall time of the measured windows
    answers_text: list[str] = field(default_factory=list)
    by_index: dict[int, str] = field(default_factory=dict)  # request index -> answer
    # The server process's own work in the measured windows, read from /proc: CPU seconds
    # (user + system) and minor page faults. Unlike latency they hardly move when other
    # processes share the machine: what a serving change costs per answer, measured exactly.
    cpu_s: float = 0.0
    system_s: float = 0.0
    minor_faults: int = 0
    # (answers, wall seconds) of each round's window: the rounds alternate the trees, so the
    # ratio of a round's two throughputs is one paired sample of the speed-up
    rounds: list[tuple[int, float]] = field(default_factory=list)


def process_counters(pid: int) -> tuple[float, float, int]:
    """(user seconds, system seconds, minor faults) of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    # after the command: state(0) ppid pgrp session tty tpgid flags minflt(7) cminflt majflt
    # cmajflt utime(11) stime(12)
    return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])


class Client:
    def __init__(self, server: Server, protos: list, timeout_s: float) -> None:
        import grpc

        from openbook.v1 import generator_pb2_grpc

        assert server.proc is not None
        self.pid = server.proc.pid
        self.grpc = grpc
        self.channel = grpc.insecure_channel(server.addr)
        self.stub = generator_pb2_grpc.GeneratorStub(self.channel)
        self.protos = protos
        self.timeout_s = timeout_s

    def one(self, i: int) -> tuple[float, str | None, str]:
        """(seconds, error or None, answer text) of request i (mod the list)."""
        t0 = time.perf_counter()
        try:
            reply = self.stub.Generate(self.protos[i % len(self.protos)], timeout=self.timeout_s)
        except self.grpc.RpcError as exc:
            return time.perf_counter() - t0, f"{exc.code().name}: {exc.details()}", ""
        text = reply.hypotheses[0].text if reply.hypotheses else ""
        return time.perf_counter() - t0, None, text

    def close(self) -> None:
        self.channel.close()


def run_window(
    client: Client,
    clients: int,
    start: int,
    seconds: float | None,
    per_client: int | None,
    sample: Sample,
    progress,
) -> int:
    """``clients`` threads, back to back, request indexes start, start+1, ... shared in order;
    until ``seconds`` pass (requests in flight then finish and count) or ``per_client`` each.
    Returns the next request index."""
    lock = threading.Lock()
    counter = [start]
    deadline = time.perf_counter() + seconds if seconds is not None else None
    results: list[tuple[int, float, str | None, str]] = []

    def worker() -> None:
        done = 0
        while True:
            if per_client is not None and done >= per_client:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            with lock:
                i = counter[0]
                counter[0] += 1
            r = client.one(i)
            done += 1
            with lock:
                results.append((i, *r))
            progress.update(1)

    t0 = time.perf_counter()
    user0, system0, faults0 = process_counters(client.pid)
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    sample.busy_s += elapsed
    sample.rounds.append((sum(1 for _, _, error, _ in results if error is None), elapsed))
    user1, system1, faults1 = process_counters(client.pid)
    sample.cpu_s += (user1 - user0) + (system1 - system0)
    sample.system_s += system1 - system0
    sample.minor_faults += faults1 - faults0
    for i, latency, error, text in results:
        if error is None:
            sample.latencies.append(latency)
            sample.answers += 1
            sample.by_index.setdefault(i % len(client.protos), text)
            if len(sample.answers_text) < 3:
                sample.answers_text.append(text)
        else:
            sample.errors.append(error)
    return counter[0]


def warm_up(client: Client, clients: int, name: str) -> None:
    errors = []

    def one(i: int) -> None:
        _, error, _ = client.one(10_000 + i)
        if error:
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"warning: {name} warm-up errors: {errors[:3]}", file=sys.stderr)


def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(sample: Sample) -> dict:
    return {
        "answers": sample.answers,
        "errors": len(sample.errors),
        "error_kinds": sorted(set(sample.errors))[:10],
        "p50_ms": ms(percentile(sample.latencies, 50)),
        "p99_ms": ms(percentile(sample.latencies, 99)),
        "mean_ms": ms(sum(sample.latencies) / len(sample.latencies)) if sample.latencies else None,
        "answers_per_s": round(sample.answers / sample.busy_s, 3) if sample.busy_s else None,
        "answers_per_s_by_round": [round(a / s, 3) if s else None for a, s in sample.rounds],
        "wall_s": round(sample.busy_s, 2),
        "server_cpu_s_per_answer": per_answer(sample.cpu_s, sample.answers, 3),
        "server_system_s_per_answer": per_answer(sample.system_s, sample.answers, 3),
        "minor_faults_per_answer": per_answer(sample.minor_faults, sample.answers, 0),
        "example_answers": sample.answers_text,
    }


def per_answer(total: float, answers: int, digits: int) -> float | None:
    return round(total / answers, digits) if answers else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def measure(args: argparse.Namespace, clients: dict[str, Client]) -> dict:
    from tqdm import tqdm

    names = list(clients)
    samples = {c: {n: Sample() for n in names} for c in args.levels}
    warmed: set[tuple[int, str]] = set()
    next_index = dict.fromkeys(((c, n) for c in args.levels for n in names), 0)
    n1 = split(args.requests_1, args.rounds)
    per_client = split(args.requests_per_client, args.rounds) if args.requests_per_client else None
    window_s = None if per_client else args.seconds / args.rounds
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for c in args.levels:
            for name in order:
                client = clients[name]
                if (c, name) not in warmed:
                    warm_up(client, c, name)
                    warmed.add((c, name))
                desc = f"round {r + 1}/{args.rounds} {c:>2} client(s) {name:<8}"
                if c == 1:
                    window, each = None, n1[r]
                else:
                    window, each = window_s, per_client[r] if per_client else None
                total = each * c if each is not None else None
                # each tree goes on through the request list where its last window stopped
                with tqdm(total=total, desc=desc, unit="req", file=sys.stderr) as bar:
                    next_index[c, name] = run_window(
                        client, c, next_index[c, name], window, each, samples[c][name], bar
                    )
    levels = {c: {n: summarize(samples[c][n]) for n in names} for c in args.levels}
    if len(names) == 2:
        for c in args.levels:
            levels[c]["throughput_ratio_by_round"] = round_ratios(
                samples[c]["current"].rounds, samples[c]["baseline"].rounds
            )
        # Greedy decoding of the same requests: the answers should agree (batching may change
        # float rounding, so a few may not).
        for c in args.levels:
            a, b = (samples[c][n].by_index for n in names)
            common = sorted(set(a) & set(b))
            same = sum(a[i] == b[i] for i in common)
            levels[c]["same_answers"] = {"same": same, "compared": len(common)}
    return levels


def round_ratios(current: list[tuple[int, float]], baseline: list[tuple[int, float]]) -> dict:
    """The throughput ratio (current / baseline) of each round, and their geometric mean with
    its 95% interval: Student's t over the rounds' log ratios (the rounds are the paired
    samples: each measures both trees back to back, in alternating order). No interval from
    fewer than two rounds."""
    ratios = [
        (a / s) / (b / t)
        for (a, s), (b, t) in zip(current, baseline, strict=True)
        if a and b and s and t
    ]
    out: dict = {"ratios": [round(r, 3) for r in ratios]}
    if len(ratios) < 2:
        return out
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    out.update(
        mean=round(math.exp(mean), 3),
        low=round(math.exp(mean - half), 3),
        high=round(math.exp(mean + half), 3),
    )
    return out


# ---------------------------------------------------------------------------------------------
# report


def machine_info() -> dict:
    import torch

    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "bf16_flags": bf16_flags(),
    }


def bf16_flags() -> list[str]:
    """The processor's bfloat16 matrix flags: what bf16 speed (and ``auto`` precision) hangs on
    (AMX on some machines of this workplace, AVX512-BF16 only on others)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    lines = [ln for ln in text.splitlines() if ln.startswith("flags")]
    flags = lines[0].split(":", 1)[1].split() if lines else []
    return [f for f in ("amx_bf16", "amx_tile", "avx512_bf16") if f in flags]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# generator engine: baseline {result['baseline']['ref']} vs current",
        "",
        f"{m['date']} · {m['platform']} · {m['processor']} "
        f"({', '.join(m.get('bf16_flags') or ['no bf16 flags'])}) · {m['cpu_count']} CPUs "
        f"({m['cpus_usable']} usable) · Python {m['python']} · torch {m['torch']} "
        f"({m['torch_threads']} threads)",
        "",
    ]
    for name in ("baseline", "current"):
        t = result.get(name)
        if t and t.get("info"):
            i = t["info"]
            lines.append(
                f"- {name}: {t['tree']} @ {t['commit'][:9]}"
                f"{' (+ local changes)' if t.get('dirty') else ''}"
                f" · {i['model_version']} ({i['model_type']}) on {i['device']}/{i['dtype']},"
                f" ready in {i['load_s']} s"
            )
    s = result["settings"]
    lines += [
        f"- requests: {s['questions']} questions, k={s['k']} passages from {s['index']}, "
        "default decoding; rounds: "
        f"{s['rounds']}; 1 client: {s['requests_1']} sequential; more: "
        + (
            f"{s['requests_per_client']} per client"
            if s["requests_per_client"]
            else f"{s['seconds']:g} s"
        )
        + " per tree and level",
        "",
        "| clients | base p50 ms | cur p50 ms | p50 ratio (base/cur) | base p99 ms | cur p99 ms "
        "| base ans/s | cur ans/s | throughput ratio (cur/base) | answers (base/cur) "
        "| errors (base/cur) | same answers |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, row in result["levels"].items():
        b, k = row.get("baseline", {}), row.get("current", {})
        same = row.get("same_answers")
        same_cell = f"{same['same']}/{same['compared']}" if same else "-"
        lines.append(
            f"| {c} | {fmt(b.get('p50_ms'))} | {fmt(k.get('p50_ms'))} "
            f"| {ratio(b.get('p50_ms'), k.get('p50_ms'))} "
            f"| {fmt(b.get('p99_ms'))} | {fmt(k.get('p99_ms'))} "
            f"| {fmt(b.get('answers_per_s'), 2)} | {fmt(k.get('answers_per_s'), 2)} "
            f"| {ratio(k.get('answers_per_s'), b.get('answers_per_s'))} "
            f"| {b.get('answers', '-')}/{k.get('answers', '-')} "
            f"| {b.get('errors', '-')}/{k.get('errors', '-')} | {same_cell} |"
        )
    for c, row in result["levels"].items():
        by_round = row.get("throughput_ratio_by_round")
        if by_round and by_round.get("ratios"):
            each = ", ".join(f"{r:.2f}x" for r in by_round["ratios"])
            line = f"\n{c} client(s), throughput ratio (cur/base) by round: {each}"
            if "mean" in by_round:
                line += (
                    f"; geometric mean {by_round['mean']:.2f}x "
                    f"[{by_round['low']:.2f}, {by_round['high']:.2f}] (95%, t over the rounds)"
                )
            lines.append(line)
    lines += [
        "",
        "The server's own work per answer (/proc: CPU seconds, of them system, minor page "
        "faults; little moved by other load on the machine):",
        "",
        "| clients | base CPU s | cur CPU s | CPU ratio (base/cur) | base system s "
        "| cur system s | base faults | cur faults |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, row in result["levels"].items():
        b, k = row.get("baseline", {}), row.get("current", {})
        lines.append(
            f"| {c} | {fmt(b.get('server_cpu_s_per_answer'), 2)} "
            f"| {fmt(k.get('server_cpu_s_per_answer'), 2)} "
            f"| {ratio(b.get('server_cpu_s_per_answer'), k.get('server_cpu_s_per_answer'))} "
            f"| {fmt(b.get('server_system_s_per_answer'), 2)} "
            f"| {fmt(k.get('server_system_s_per_answer'), 2)} "
            f"| {fmt(b.get('minor_faults_per_answer'))} | {fmt(k.get('minor_faults_per_answer'))} |"
        )
    for c, row in result["levels"].items():
        for name in ("baseline", "current"):
            for kind in row.get(name, {}).get("error_kinds", []):
                lines.append(f"\nerror ({name}, {c} clients): {kind}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        sys.exit(f"no model at {args.model} (openbook-trainer demo prepare, or --model)")
    commit = ensure_baseline_tree(args.baseline_tree.resolve(), args.baseline_ref)
    trees = {"baseline": args.baseline_tree.resolve(), "current": args.current_tree.resolve()}
    if args.only != "both":
        trees = {args.only: trees[args.only]}

    requests = load_requests(args)
    protos = to_protos(requests)
    workdir = args.var / "bench" / "generator-engine"
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")

    servers: dict[str, Server] = {}
    for name, tree in trees.items():
        servers[name] = Server(name, tree, free_port(), workdir / f"{stamp}-{name}.log")
        servers[name].modules = verify_imports(name, tree)
        print(f"{name}: {servers[name].modules}", file=sys.stderr)

    redis = None
    if shutil.which("redis-server"):
        redis = RedisServer(Path(tempfile.mkdtemp(prefix="redis-", dir=workdir)))
        redis.start()
    else:
        print(
            "warning: no redis-server: the servers use their default OPENBOOK_REDIS_URL",
            file=sys.stderr,
        )
    clients: dict[str, Client] = {}
    try:
        for db, (name, server) in enumerate(servers.items()):
            print(
                f"starting {name} server on {server.addr} (log {server.log_path})", file=sys.stderr
            )
            redis_url = f"{redis.url.rsplit('/', 1)[0]}/{db}" if redis else None
            server.start(args, redis_url, workdir)
            server.wait_ready(args.startup_timeout)  # one model load at a time
            print(f"{name} ready: {server.info}", file=sys.stderr)
            clients[name] = Client(server, protos, args.timeout)
        levels = measure(args, clients)
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()
        if redis:
            redis.stop()

    current = args.current_tree.resolve()
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", cwd=current))
    result = {
        "machine": machine_info(),
        "settings": {
            "index": args.index,
            "k": args.k,
            "questions": len(requests),
            "rounds": args.rounds,
            "requests_1": args.requests_1,
            "seconds": args.seconds,
            "requests_per_client": args.requests_per_client,
            "model": str(args.model),
            "levels": args.levels,
        },
        "levels": {str(c): v for c, v in levels.items()},
    }
    for name, server in servers.items():
        result[name] = {
            "tree": str(server.tree),
            "ref": args.baseline_ref if name == "baseline" else "working tree",
            "commit": commit if name == "baseline" else git("rev-parse", "HEAD", cwd=current),
            "dirty": dirty if name == "current" else False,
            "modules": server.modules,
            "info": server.info,
        }
    result.setdefault("baseline", {"ref": args.baseline_ref})
    text = report(result)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
