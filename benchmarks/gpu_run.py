"""The GPU runner: one job per command, with the environment the lent GPU machines need.

    python3 benchmarks/gpu_run.py JOB [options] [-- arguments passed on to the tool]

  suite       tests/dist and tests/gpu over NCCL, spread over pytest-xdist sessions
  peers       benchmarks/peers.py: models x stacks, each stack in its own process (or --together)
  moe         benchmarks/moe_peers.py: mixture-of-experts stacks (fsdp8 EP, FSDP2, torchtitan), each in its own process
  scaling     peers.py at --nproc GPUs and at --base GPUs, then scaling.py's weak-scaling table
  plan        fsdp8 bench beside the planner: models x worlds x AC modes x FP8 recipes
  ab          two revisions of fsdp8 on one model, run after run (old, new, new, old)
  prepare     (where git is) a revision's fsdp8/ and benchmarks/ into .ab/REV, to carry
  sync        benchmarks/sync_check.py: does a training step make the host wait for the GPU
  checkpoint  benchmarks/checkpoint_bench.py: save, asynchronous save and load times
  script      any command (a script of benchmarks/ or benchmarks/debug/) in this environment

Every job sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
(the lent machines' NVLink multicast is off), installs the carried wheels (--wheels, default
.whl/*.whl) into /tmp/site and puts them and this checkout on PYTHONPATH, appends the GPUs,
topology and package versions to env.txt, and writes its logs and JSON under --out (default
$OUT, else runs/gpu), named after the job. --limit bounds the whole job: each run inside gets
what is left (a run past its time gets SIGINT, so pytest and torchrun still report, then
SIGKILL). --dry-run prints the commands instead. `JOB -h` lists a job's options.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = "/tmp/site"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# fsdp8 bench flags for peers.py's models A and B (the built-in Llama at their sizes), a small
# host-bound model and the CPU-sized default.
BENCH_MODELS = {
    "A": "--layers 16 --hidden 2048 --ffn 8192 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4",
    "B": "--layers 8 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 2",
    "SMALL": "--layers 8 --hidden 512 --ffn 1536 --heads 8 --kv-heads 4 --vocab 256 --seq-len 1024 --micro-batch 8",
    "tiny": "--model tiny",
}
FLAT_STACKS = "fsdp8,fsdp2,fsdp8-fp8-current-compile,fsdp8-fp8-block-compile,torchao-compile"
HSDP_STACKS = "fsdp8-hsdp-noshard,fsdp8-hsdp-optim,fsdp2-hsdp"
VERSIONS = """
import importlib, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
for name in ('triton', 'transformers', 'torchao', 'megatron_fsdp'):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as err:
        print(name, 'not importable:', type(err).__name__)
"""


def csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


class Session:
    """One job's output folder, environment, time limit and runs."""

    def __init__(self, args: argparse.Namespace):
        self.out = Path(args.out).resolve()
        self.dry = args.dry_run
        self.limit = args.limit
        self.t0 = time.monotonic()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **MULTICAST_OFF)
        self.runs = 0
        self.numa = args.numa_binding

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.t0)

    def deadline(self, cap: float, keep: float = 0) -> int:
        """Seconds for the next run: at most `cap`, leaving `keep` of the job's limit."""
        return max(1, int(min(cap, self.left() - keep)))

    def say(self, text: str) -> None:
        print(f"[gpu_run {time.monotonic() - self.t0:5.0f} s] {text}", flush=True)

    def run(self, cmd: list, log: str | None = None, seconds: float | None = None, env: dict | None = None,
            cwd: Path | None = None, stdout: str | None = None) -> int:
        """Run `cmd` in a process group of its own, its output into `log` under --out (stdout
        into `stdout` instead, where given; no log: this terminal). 124 if it ran out of time."""
        self.runs += 1
        if self.numa and [str(c) for c in cmd[:len(TORCHRUN)]] == TORCHRUN:
            cmd = [*TORCHRUN, "--numa-binding", self.numa, *cmd[len(TORCHRUN):]]
        seconds = seconds if seconds is not None else self.deadline(self.limit)
        shown = " ".join([f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()] + [shlex.join(map(str, cmd))])
        if log:
            shown += f" >{stdout} 2>{log}" if stdout else f" >{log} 2>&1"
        print(f"$ {f'(cd {cwd} && {shown})' if cwd else shown}  # limit {seconds} s", flush=True)
        if self.dry:
            return 0
        out = open(self.out / (stdout or log), "w") if log else None
        err = open(self.out / log, "w") if log and stdout else (subprocess.STDOUT if log else None)
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, cwd=cwd,
                                env=dict(self.env, **(env or {})), start_new_session=True)
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):  # SIGINT: pytest, torchrun still report
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            self.say(f"stopped after {seconds} s: {shlex.join(map(str, cmd))[:160]}")
            return 124
        finally:
            for f in (out, err):
                if hasattr(f, "close"):
                    f.close()

    def text(self, name: str) -> str:
        path = self.out / name
        return path.read_text(errors="replace") if path.exists() else ""

    def last_error(self, log: str) -> str:
        """The line of `log` that says what went wrong: the exception, else an error line."""
        lines = [ln.strip() for ln in self.text(log).splitlines()]
        for pick in (lambda ln: re.match(r"[\w.]*(Error|Exception)\b", ln) and "ChildFailedError" not in ln,
                     lambda ln: "error:" in ln.lower()):
            hits = [ln for ln in lines if pick(ln)]
            if hits:
                return hits[-1][:200]
        return f"no error line in {log}"


def setup(s: Session, args: argparse.Namespace) -> None:
    """The carried wheels and this checkout on PYTHONPATH; env.txt."""
    s.out.mkdir(parents=True, exist_ok=True)
    paths = []
    wheels = [] if args.wheels == "none" else sorted(glob.glob(str(REPO / args.wheels)))
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", SITE, *wheels]
        if s.run(pip, log=f"{args.job}-pip.log", seconds=300) == 0:
            paths.append(SITE)
            s.env["PATH"] = f"{SITE}/bin:{s.env.get('PATH', '')}"
        else:
            s.say(f"wheels not installed: {s.last_error(f'{args.job}-pip.log')}")
    paths += [str(REPO)] + ([s.env["PYTHONPATH"]] if s.env.get("PYTHONPATH") else [])
    s.env["PYTHONPATH"] = ":".join(paths)
    if s.dry:
        return

    def output(cmd: list) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=s.env, cwd=REPO)
            return (done.stdout + done.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{cmd[0]}: {err}"

    gpus = output(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    versions = output([sys.executable, "-c", VERSIONS])
    cpu = [ln for ln in output(["lscpu"]).splitlines() if ln.startswith(("Model name", "CPU(s)"))]
    parts = [f"## {time.strftime('%Y-%m-%d %H:%M:%S')} gpu_run.py {shlex.join(sys.argv[1:])}",
             f"checkout: {output(['git', 'log', '-1', '--format=%H %s'])}", gpus,
             output(["nvidia-smi", "topo", "-m"]), *cpu, versions, ""]
    with open(s.out / "env.txt", "a") as f:
        f.write("\n".join(parts) + "\n")
    print(gpus, "\n" + " | ".join(versions.splitlines()), flush=True)


# ----------------------------------------------------------------------------- suite


def job_suite(s: Session, a: argparse.Namespace, rest: list) -> int:
    xdist = a.xdist
    if xdist is None:  # as many sessions as the tests can use, where pytest-xdist is installed
        xdist = 12 if s.dry or subprocess.run([sys.executable, "-c", "import xdist"], env=s.env,
                                              capture_output=True).returncode == 0 else 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=25",
           f"--junitxml={s.out / 'suite-junit.xml'}", *(["-n", str(xdist), "--dist", "load"] if xdist else []),
           *a.tests, *rest]
    env = {"FSDP8_TEST_BACKEND": a.backend, "FSDP8_TEST_LOG": str(s.out / "suite-outcomes.log"),
           "FSDP8_TEST_TIMEOUT": str(a.test_timeout), **({"FSDP8_TEST_WORLDS": a.worlds} if a.worlds else {})}
    start = time.monotonic()
    rc = s.run(cmd, log="suite-tests.log", seconds=s.deadline(s.limit, keep=10), env=env)
    log = s.text("suite-tests.log").splitlines()
    print(f"pytest exit {rc} after {time.monotonic() - start:.0f} s")
    print("\n".join([ln for ln in log if " passed" in ln or " failed" in ln or " error" in ln][-3:]))
    print("\n".join([ln[:220] for ln in log if ln.startswith(("FAILED", "ERROR"))][:20]))
    skips: dict[str, int] = {}
    for ln in log:  # "SKIPPED [3] tests/dist/test_x.py:12: reason"
        if ln.startswith("SKIPPED ["):
            count, _, reason = ln[len("SKIPPED ["):].partition("] ")
            reason = reason.split(": ", 1)[-1]
            skips[reason] = skips.get(reason, 0) + int(count)
    for reason, count in sorted(skips.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  skipped {count}: {reason[:180]}")
    return rc


# ----------------------------------------------------------------------------- peers


def compiled(stacks: list[str], mode: str) -> list[str]:
    """The stacks as named, each with "-compile" ("only"), or each eager then compiled ("both")."""
    if mode == "as-named":
        return stacks
    out = []
    for stack in stacks:
        eager = stack.removesuffix("-compile")
        out += [eager + "-compile"] if mode == "only" else [eager, eager + "-compile"]
    return out


def peers_row(r: dict) -> str:
    def f(key, spec):
        return "n/a" if r.get(key) is None else format(r[key], spec)
    mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    note = r.get("note", "") if r["status"] == "ok" else f"{r['status'].upper()}: {r.get('note', '')}"
    return (f"| {r['model']} | {r['stack']} | {r.get('mesh') or 'n/a'} | {f('tokens_per_s_per_gpu', ',.0f')} "
            f"| {f('step_ms_median', '.1f')} | {mfu} | {f('peak_alloc_gib', '.2f')} | {f('peak_reserved_gib', '.2f')} "
            f"| {f('loss_first', '.4f')} / {f('loss_last', '.4f')} | {note[:100]} |")


PEERS_HEAD = ("| model | stack | mesh | tokens/s/GPU | step ms | MFU | peak alloc GiB | peak reserved GiB "
              "| loss first / last | notes |\n|---|---|---|---:|---:|---:|---:|---:|---|---|")


def read_results(s: Session, name: str) -> list[dict]:
    try:
        return json.loads(s.text(name))["results"]
    except (ValueError, KeyError):
        return []


def run_and_report(s: Session, name: str, cmd: list, seconds: int, what: str, env: dict | None = None,
                   cwd: Path | None = None) -> list[dict]:
    """Run a benchmark that writes ``name``.json under --out; its rows printed and returned (a
    failed run: one row saying why, ``what`` naming the model and stacks)."""
    if not s.dry:  # a stale file would pass for this run's results
        (s.out / f"{name}.json").unlink(missing_ok=True)
    rc = s.run(cmd, log=f"{name}.log", seconds=seconds, env=env, cwd=cwd)
    results = read_results(s, f"{name}.json")
    for r in results:
        print(peers_row(r), flush=True)
    if not results and not s.dry:
        print(f"| {what} | | failed (exit {rc}): {s.last_error(f'{name}.log')} |", flush=True)
    return results


def peers_run(s: Session, name: str, nproc: int, models: str, stacks: str, a: argparse.Namespace, rest: list,
              seconds: int, gpus: str = "", tree: Path = REPO, env: dict | None = None) -> list[dict]:
    """One torchrun of `tree`'s peers.py; its rows printed and returned (a failed run: one row saying why)."""
    s.runs += 1
    cmd = [*TORCHRUN, "--nproc_per_node", nproc, "--master_port", 29500 + s.runs % 200,
           tree / "benchmarks" / "peers.py", "--models", models, "--stacks", stacks, "--warmup", a.warmup,
           "--steps", a.steps, "--out", s.out / f"{name}.json",
           *(["--loopback-world", a.loopback] if getattr(a, "loopback", 0) else []),
           *(["--profile", s.out / f"{name}-prof"] if getattr(a, "profile", False) else []), *rest]
    env = dict(env or {}, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}))
    if tree != REPO:
        env["PYTHONPATH"] = ":".join(p for p in s.env["PYTHONPATH"].split(":") if p != str(REPO))
    results = run_and_report(s, name, cmd, seconds, f"{models} | {stacks}", env=env, cwd=tree if tree != REPO else None)
    if getattr(a, "profile", False) and not getattr(a, "keep_traces", True):
        for trace in glob.glob(str(s.out / f"{name}-prof" / "*.json.gz")):
            os.remove(trace)
    return results


def job_peers(s: Session, a: argparse.Namespace, rest: list) -> int:
    env = dict(item.split("=", 1) for item in a.env)
    stacks = compiled(csv(a.stacks), a.compile)
    tag = "peers" + (f"-loop{a.loopback}" if a.loopback else "")
    print(PEERS_HEAD)
    for rep in range(1, a.repeat + 1):
        suffix = f"-r{rep}" if a.repeat > 1 else ""
        if a.together:
            peers_run(s, f"{tag}{suffix}", a.nproc, a.models, ",".join(stacks), a, rest,
                      s.deadline(s.limit, keep=5), a.gpus, env=env)
            continue
        for model in csv(a.models):
            for i, stack in enumerate(stacks):
                name = f"{tag}-{model}-{stack}{suffix}" + (f"-{i}" if stacks.count(stack) > 1 else "")
                peers_run(s, name, a.nproc, model, stack, a, rest, s.deadline(a.run_limit, keep=5), a.gpus,
                          env=env)
    return 0


def job_moe(s: Session, a: argparse.Namespace, rest: list) -> int:
    print(PEERS_HEAD)
    for stack in csv(a.stacks):
        name = f"moe-{a.model}-{stack}"
        cmd = [*TORCHRUN, "--nproc_per_node", a.nproc, "--master_port", 29500 + (s.runs + 1) % 200,
               REPO / "benchmarks" / "moe_peers.py", "--model", a.model, "--stacks", stack, "--warmup", a.warmup,
               "--steps", a.steps, "--out", s.out / f"{name}.json", *rest]
        run_and_report(s, name, cmd, s.deadline(a.run_limit, keep=5), f"{a.model} | {stack}")
    return 0


def job_scaling(s: Session, a: argparse.Namespace, rest: list) -> int:
    """The big run first (HSDP too), then the base (and extra counts) on the first GPUs, then the table."""
    rest = ["--hsdp-replicate", str(a.hsdp_replicate), "--timeout-s", str(a.coll_timeout), *rest]
    print(PEERS_HEAD)
    peers_run(s, f"scaling-peers{a.nproc}", a.nproc, a.models, a.stacks, a, rest, s.deadline(330, keep=150))
    jsons = []
    for n in [a.base, *map(int, csv(a.extra_nprocs))]:
        peers_run(s, f"scaling-peers{n}", n, a.models, a.base_stacks, a, rest, s.deadline(210, keep=40),
                  gpus=",".join(map(str, range(n))))
        jsons.append(s.out / f"scaling-peers{n}.json")
    jsons.append(s.out / f"scaling-peers{a.nproc}.json")
    return s.run([sys.executable, REPO / "benchmarks" / "scaling.py", *jsons, "--base", a.base,
                  "--out", s.out / "scaling.md"], seconds=60)


# ----------------------------------------------------------------------------- plan


def bench_summary(s: Session, name: str, label: str) -> str:
    text = s.text(f"{name}.json")
    try:
        d = json.loads(text[text.index("{"):])
    except ValueError:
        return f"{label:<22} failed: {s.last_error(f'{name}.log')}"
    m, p, r, h = d["measured"], d["predicted"], d["ratio"], d.get("host")

    def ratio(key):
        return "n/a" if r[key] is None else f"{r[key]:.3f}"
    peak = "n/a" if m["peak_allocated_gib"] is None else f"{m['peak_allocated_gib']:6.2f}"
    host = f"; per-op host model {h['per_op_model_step_ms']:.1f} ({h['per_op_model_ratio']:.3f})" if h else ""
    return (f"{label:<22} {m['tokens_per_s_per_gpu']:>8,.0f} tok/s/GPU  "
            f"step {m['step_ms']:7.1f} / {p['step_ms']:7.1f} ms ({ratio('step_ms')}{host})  "
            f"peak {peak} / {p['peak_allocated_gib']:6.2f} GiB ({ratio('peak_allocated_gib')})"
            f"  exposed {m['exposed_comm_ms']:.1f} / {p['exposed_comm_ms']:.1f} ms  [{d['setup'][:70]}]")


def job_plan(s: Session, a: argparse.Namespace, rest: list) -> int:
    for rep in range(1, a.repeat + 1):
        for model in csv(a.models):
            for world in map(int, csv(a.worlds)):
                for ac in csv(a.ac):
                    for fp8 in csv(a.fp8):
                        label = f"{model}-{world}-{ac}" + ("" if fp8 == "none" else f"-{fp8}")
                        label += f"-r{rep}" if a.repeat > 1 else ""
                        flags = [*BENCH_MODELS[model].split(), "--ac", ac, "--fp8", fp8, "--steps", a.steps,
                                 "--warmup", a.warmup, "--json", *rest]
                        if world == 1 or a.real:
                            cmd = [sys.executable, "-m", "fsdp8", "bench", "--nproc", world, *flags]
                        else:  # one GPU plays rank 0 of the world (fsdp8/app/bench/loopback.py)
                            cmd = [sys.executable, REPO / "benchmarks" / "bench_loopback.py", "--world", world, *flags]
                        name = f"plan-{label}"
                        s.run(cmd, log=f"{name}.log", stdout=f"{name}.json", seconds=s.deadline(a.run_limit, keep=5))
                        if not s.dry:
                            print(bench_summary(s, name, label), flush=True)
    return 0


# ----------------------------------------------------------------------------- ab


def tree_of(rev: str, own_harness: bool) -> tuple[Path, str]:
    """A folder holding `rev`'s fsdp8/ and benchmarks/ (this checkout's benchmarks/ unless
    own_harness, so the two sides differ in fsdp8 only), and the revision's description."""
    if rev == ".":
        # A machine without this repository's current .git (a copied working tree) describes its
        # HEAD wrongly: `prepare` recorded what the checkout was where git is.
        recorded = REPO / ".ab" / "CHECKOUT"
        if recorded.is_file():  # run `prepare` again after committing, or this names an older HEAD
            return REPO, f"this checkout, as `prepare` last recorded it: {recorded.read_text().strip()}"
        return REPO, "this checkout: " + describe(REPO, "HEAD")
    tree = Path(tempfile.mkdtemp(prefix="fsdp8-ab-"))
    prepared = REPO / ".ab" / rev
    if prepared.is_dir():  # carried from a machine with git (`gpu_run.py prepare REV`)
        shutil.copytree(prepared / "fsdp8", tree / "fsdp8")
        shutil.copytree(prepared / "benchmarks", tree / "benchmarks")
        desc = (prepared / "REVISION").read_text().strip()
    elif archive(rev, tree) == 0:
        desc = describe(REPO, rev)
    else:
        raise SystemExit(f"ab: no .ab/{rev} here and `git archive {rev}` failed; on a machine with the "
                         f"repository run `python3 benchmarks/gpu_run.py prepare {rev}` and carry .ab")
    if not own_harness:
        shutil.rmtree(tree / "benchmarks")
        shutil.copytree(REPO / "benchmarks", tree / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    return tree, desc


def archive(rev: str, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(["git", "-C", str(REPO), "archive", rev, "fsdp8", "benchmarks"], capture_output=True)
    if git.returncode != 0:
        return git.returncode
    return subprocess.run(["tar", "-x", "-C", str(dest)], input=git.stdout).returncode


def describe(repo: Path, rev: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%h %cs %s", rev],
                          capture_output=True, text=True)
    return done.stdout.strip()[:100] if done.returncode == 0 else f"{rev} (no git)"


def job_prepare(s: Session, a: argparse.Namespace, rest: list) -> int:
    for rev in a.revs:
        dest = REPO / ".ab" / rev
        shutil.rmtree(dest, ignore_errors=True)
        if archive(rev, dest) != 0:
            raise SystemExit(f"prepare: `git archive {rev}` failed")
        (dest / "REVISION").write_text(describe(REPO, rev) + "\n")
        print(f"{dest.relative_to(REPO)}: {describe(REPO, rev)}  (carry .ab)")
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    checkout = describe(REPO, "HEAD") + (" + uncommitted changes" if dirty else "")
    (REPO / ".ab" / "CHECKOUT").write_text(checkout + "\n")
    return 0


def job_ab(s: Session, a: argparse.Namespace, rest: list) -> int:
    sides = {}
    try:
        for side, rev in (("old", a.old), ("new", a.new)):
            sides[side] = (REPO, rev) if s.dry else tree_of(rev, a.own_harness)
            print(f"{side}: {sides[side][1]}  ({sides[side][0]})")
        print(PEERS_HEAD)
        rows: dict[tuple[str, str], list[dict]] = {}
        for i, side in enumerate(csv(a.order), 1):
            name = f"ab-{i}-{side}"
            results = peers_run(s, name, a.nproc, a.models, a.stacks, a, rest, s.deadline(a.run_limit, keep=5),
                                tree=sides[side][0])
            ran = json.loads(s.text(f"{name}.json") or "{}").get("environment", {}).get("fsdp8")
            if ran and Path(ran).parent.resolve() != sides[side][0].resolve():
                raise SystemExit(f"ab: the {side} run imported {ran}, not {sides[side][0]}/fsdp8")
            for r in results:
                if r["status"] == "ok":
                    rows.setdefault((r["model"], r["stack"]), []).append({"side": side, **r})
    finally:
        for tree, _ in sides.values():
            if tree != REPO:
                shutil.rmtree(tree, ignore_errors=True)
    for (model, stack), runs in rows.items():
        print(ab_summary(model, stack, runs), flush=True)
    return 0


def ab_summary(model: str, stack: str, runs: list[dict]) -> str:
    """Each side's mean tokens/s/GPU and runs, new / old, the spread within a side, the peaks."""
    speed = {side: [r["tokens_per_s_per_gpu"] for r in runs if r["side"] == side] for side in ("old", "new")}
    if not (speed["old"] and speed["new"]):
        return f"model {model}, {stack}: no ratio, a side has no run that finished"
    mean = {side: statistics.mean(v) for side, v in speed.items()}
    spread = {side: 100 * (max(v) - min(v)) / mean[side] for side, v in speed.items()}
    peak = {side: [r["peak_alloc_gib"] for r in runs if r["side"] == side and r["peak_alloc_gib"] is not None]
            for side in speed}
    peaks = " / ".join(f"{max(peak[side]):.2f}" if peak[side] else "n/a" for side in speed)
    runs_of = {side: ", ".join(f"{x:,.0f}" for x in v) for side, v in speed.items()}
    return (f"\nmodel {model}, {stack}: old {mean['old']:,.0f} tokens/s/GPU ({runs_of['old']}), new "
            f"{mean['new']:,.0f} ({runs_of['new']}): new / old {mean['new'] / mean['old']:.3f}; spread within a "
            f"side {spread['old']:.1f}% / {spread['new']:.1f}%; peak alloc GiB old / new {peaks}")


# ----------------------------------------------------------------------------- sync, checkpoint, script


def job_sync(s: Session, a: argparse.Namespace, rest: list) -> int:
    rc = s.run([sys.executable, REPO / "benchmarks" / "sync_check.py", "--json", s.out / "sync.json", *rest],
               log="sync.log", stdout="sync.txt", seconds=s.deadline(s.limit, keep=5))
    print(s.text("sync.txt"), end="")
    return rc


def job_checkpoint(s: Session, a: argparse.Namespace, rest: list) -> int:
    cmd = [*TORCHRUN, "--nproc_per_node", a.nproc, REPO / "benchmarks" / "checkpoint_bench.py",
           "--preset", a.preset, "--dir", a.dir, *rest]
    rc = s.run(cmd, log="checkpoint.log", seconds=s.deadline(s.limit, keep=15))
    print("\n".join(ln for ln in s.text("checkpoint.log").splitlines() if ln.startswith(("|", "##", "bytes"))))
    if not s.dry:
        shutil.rmtree(a.dir, ignore_errors=True)
    return rc


def job_script(s: Session, a: argparse.Namespace, rest: list) -> int:
    if not rest:
        raise SystemExit("script: give the command after --, e.g. script -- benchmarks/fp8_gemm.py --tokens 8192")
    cmd = [sys.executable, *rest] if rest[0].endswith(".py") else rest
    name = a.name or "script-" + Path(rest[0]).stem
    env = dict(item.split("=", 1) for item in a.env)
    rc = s.run(cmd, log=f"{name}.log", seconds=s.deadline(s.limit, keep=5), env=env)
    print(f"(exit {rc})\n" + "\n".join(s.text(f"{name}.log").splitlines()[-a.tail:]))
    return rc


# ----------------------------------------------------------------------------- arguments


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_run.py", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu", help="results folder (default: $OUT)")
    common.add_argument("--limit", type=int, default=540, help="seconds for the whole job (default: 540)")
    common.add_argument("--wheels", default=".whl/*.whl", help="wheels to install into /tmp/site, or none")
    common.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    common.add_argument("--numa-binding", default="", choices=("", "node", "socket", "exclusive", "core-complex"),
                        help="torchrun --numa-binding for every torchrun: each rank's host threads on CPUs near its "
                             "GPU (the compiled FP8 + TP step is host-bound on its slower hosts)")
    jobs = p.add_subparsers(dest="job", required=True)

    def job(name, func, doc):
        q = jobs.add_parser(name, parents=[common], help=doc, description=doc)
        q.set_defaults(func=func)
        return q

    def peers_options(q, models, stacks, nproc, steps, run_limit):
        q.add_argument("--models", default=models, help=f"peers.py models, comma list (default: {models})")
        q.add_argument("--stacks", default=stacks, help=f"peers.py stacks, comma list (default: {stacks})")
        q.add_argument("--nproc", type=int, default=nproc, help=f"GPUs, one rank each (default: {nproc})")
        q.add_argument("--warmup", type=int, default=2)
        q.add_argument("--steps", type=int, default=steps)
        if run_limit:
            q.add_argument("--run-limit", type=int, default=run_limit, help="seconds for each peers.py process")

    q = job("suite", job_suite, "tests over NCCL (default tests/dist and tests/gpu) spread over pytest-xdist "
            "sessions; the log, each test's outcome as it ends (suite-outcomes.log) and JUnit times; extra pytest "
            "arguments after --")
    q.add_argument("tests", nargs="*", default=["tests/dist", "tests/gpu"])
    q.add_argument("--xdist", type=int, default=None, help="pytest-xdist sessions (default: 12 where installed)")
    q.add_argument("--worlds", default="", help="FSDP8_TEST_WORLDS, e.g. 1,4 (default: every size the GPUs allow)")
    q.add_argument("--test-timeout", type=int, default=150, help="FSDP8_TEST_TIMEOUT: seconds a hung test gets")
    q.add_argument("--backend", default="nccl", help="FSDP8_TEST_BACKEND (default: nccl)")

    q = job("peers", job_peers, "peers.py, each stack of each model in its own process (peak memory is the "
            "stack's own), or all in one process group (--together); peers.py flags after --, e.g. "
            "-- --skip-packed-check")
    peers_options(q, "B", "fsdp8,fsdp8-compile", 1, 8, 150)
    q.add_argument("--compile", choices=("as-named", "only", "both"), default="as-named",
                   help="only: each stack's -compile variant; both: each stack eager, then compiled")
    q.add_argument("--loopback", type=int, default=0, help="one GPU plays rank 0 of this world (--loopback-world)")
    q.add_argument("--together", action="store_true", help="every stack and model in one torchrun, one after another")
    q.add_argument("--repeat", type=int, default=1, help="run the whole list this many times")
    q.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES, e.g. 0,1")
    q.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the runs (repeatable)")
    q.add_argument("--profile", action="store_true", help="one more profiled step per stack (peers.py --profile)")
    q.add_argument("--keep-traces", action="store_true", help="keep the profiles' chrome traces (.json.gz)")

    q = job("scaling", job_scaling, "weak scaling: peers.py at --nproc GPUs (flat and HSDP stacks, one process "
            "group), the flat stacks at --base GPUs (and --extra-nprocs) on the first GPUs, then scaling.py")
    peers_options(q, "B", f"{FLAT_STACKS},{HSDP_STACKS}", 4, 8, 0)
    q.add_argument("--base", type=int, default=2, help="GPU count the efficiency is relative to (default: 2)")
    q.add_argument("--base-stacks", default=FLAT_STACKS, help=f"stacks at the base and extra counts ({FLAT_STACKS})")
    q.add_argument("--extra-nprocs", default="", help="more flat runs, e.g. 4 on an 8-GPU machine")
    q.add_argument("--hsdp-replicate", type=int, default=2)
    q.add_argument("--coll-timeout", type=int, default=120, help="peers.py --timeout-s: a hung collective ends its run")

    q = job("plan", job_plan, "fsdp8 bench beside the planner's prediction, one process per configuration: "
            "models x worlds x --ac x --fp8; worlds above 1 on one GPU (loopback) unless --real; extra fsdp8 bench "
            "flags after -- (they override the model's, e.g. -- --micro-batch 8 --tp 2 --sequence-parallel)")
    q.add_argument("--models", default="A,B", help=f"comma list of {', '.join(BENCH_MODELS)}")
    q.add_argument("--worlds", default="1,2")
    q.add_argument("--ac", default="none,selective,full")
    q.add_argument("--fp8", default="none", help="FP8 recipes, comma list (none, current, delayed, block, mxfp8)")
    q.add_argument("--real", action="store_true", help="worlds above 1 on that many GPUs (fsdp8 bench --nproc)")
    q.add_argument("--warmup", type=int, default=2)
    q.add_argument("--steps", type=int, default=10)
    q.add_argument("--repeat", type=int, default=1, help="run the grid this many times (host variance)")
    q.add_argument("--run-limit", type=int, default=150, help="seconds for each configuration")

    q = job("moe", job_moe, "moe_peers.py, each stack in its own torchrun process; moe_peers.py flags after --")
    q.add_argument("--model", default="Q")
    q.add_argument("--stacks", default="fsdp8-ep,fsdp8-ep-fp8-e4m3,fsdp2,torchtitan-ep")
    q.add_argument("--nproc", type=int, default=2)
    q.add_argument("--warmup", type=int, default=2)
    q.add_argument("--steps", type=int, default=6)
    q.add_argument("--run-limit", type=int, default=170, help="seconds for each stack's process")

    q = job("ab", job_ab, "two revisions of fsdp8 side by side: peers.py in its own process per run, alternating "
            "as --order says; both sides use this checkout's benchmarks/ unless --own-harness")
    peers_options(q, "B", "fsdp8-fp8-current-compile", 1, 8, 170)
    q.add_argument("--old", required=True, help="a git revision (or one prepared under .ab/), or . for this checkout")
    q.add_argument("--new", default=".", help="the same; default: this checkout as it is")
    q.add_argument("--order", default="old,new,new,old", help="the runs (default: old,new,new,old)")
    q.add_argument("--own-harness", action="store_true", help="each revision's own benchmarks/peers.py")

    q = job("prepare", job_prepare, "git archive each revision's fsdp8/ and benchmarks/ into .ab/REV (git-ignored), "
            "for an ab job on a machine without the repository's .git: carry .ab")
    q.add_argument("revs", nargs="+")

    job("sync", job_sync, "benchmarks/sync_check.py (its flags after --)")

    q = job("checkpoint", job_checkpoint, "benchmarks/checkpoint_bench.py under torchrun; the folder is removed after")
    q.add_argument("--nproc", type=int, default=2)
    q.add_argument("--preset", default="1b")
    q.add_argument("--dir", default="/tmp/fsdp8-ckpt", help="checkpoint folder, on the disk to measure")

    q = job("script", job_script, "a command after -- (a .py file runs under this Python) with the runner's "
            "environment, a log under --out and the time limit; the log's last --tail lines printed")
    q.add_argument("--name", default="", help="log name (default: script-<file name>)")
    q.add_argument("--tail", type=int, default=60)
    q.add_argument("--env", action="append", default=[], metavar="K=V", help="environment of the command (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:cut])
    rest = [str(x) for x in argv[cut + 1:]]
    session = Session(args)
    if args.job != "prepare":
        setup(session, args)
    rc = args.func(session, args, rest)
    session.say(f"{args.job} done, exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
