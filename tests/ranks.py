"""N ranks of a distributed run without N interpreter start-ups: the tests' torchrun.

Every rank of a 2-process test used to be a fresh interpreter importing torch, transformers,
accelerate and draftsmith (7-9 CPU-seconds each, about 60 % of such a test on a 2-core EPYC), plus a
launcher process importing torch again. Here the ranks are forked from a multiprocessing forkserver
that imported those modules once per pytest worker and never ran anything else, so each rank starts
from the same clean state a fresh interpreter has (no process group, no accelerate singletons, no
DeepSpeed engine), in torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, …).
They are real processes talking gloo over loopback, as torchrun's are. What only a real launcher
shows (`accelerate launch` through launch.sh, its presets and flags) stays tested through launch.sh
(tests/train/test_deepspeed.py) and the scaling benchmark (tests/test_bench.py).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What each rank imports anyway: paid once, in the forkserver. A test's environment (OMP_NUM_THREADS,
# DS_ACCELERATOR) is already that of the pytest worker that starts the forkserver (scripts/test.sh).
PRELOAD = ["torch", "transformers", "accelerate", "datasets", "draftsmith.cli", "draftsmith.train.loop"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(program: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    """One rank: its streams to files, torchrun's environment, then `program` as `python -m`
    (a module) or `python FILE` (a .py file) would run it; its exit status is the process's."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [program, *args]
    code = 0
    try:
        if program.endswith(".py"):
            sys.path.insert(0, str(Path(program).parent))  # as `python FILE` puts the file's folder first
            runpy.run_path(program, run_name="__main__")
        else:
            runpy.run_module(program, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as a finished interpreter, minus gloo's and DeepSpeed's teardown threads


def run_ranks(
    n: int, program: str, args: list[str], env: dict | None = None, cwd: Path = ROOT, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node n [-m] program args` -> returncode (the first non-zero rank's, else
    0), stdout and stderr (every rank's, rank 0 first). A rank still running after `timeout` seconds
    (one waiting on a collective the other never calls) is killed, and the run fails."""
    env = {**os.environ, **(env or {})}
    port = str(_free_port())
    ctx, procs, logs = _forkserver(), [], tempfile.mkdtemp(prefix="ranks-")
    for rank in range(n):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "ROLE_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        out, err = (os.path.join(logs, f"rank{rank}.{s}") for s in ("out", "err"))
        p = ctx.Process(target=_rank, args=(str(program), [str(a) for a in args], rank_env, str(cwd), out, err))
        p.start()
        procs.append((p, out, err))
    for p, *_ in procs:
        p.join(timeout)
    for p, *_ in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p, *_ in procs]
    read = [(Path(out).read_text(), Path(err).read_text()) for _, out, err in procs]
    return subprocess.CompletedProcess(
        [program, *args],
        next((c for c in codes if c != 0), 0),
        "".join(o for o, _ in read),
        "".join(e for _, e in read),
    )
