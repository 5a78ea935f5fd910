"""The scripts under benchmarks/ keep working as fsdp8 changes: each imports as a module (its
main not run), and every fsdp8 name it uses, at import or inside a function, exists in the
package's source, so a renamed or moved module fails here on a CPU rather than on a GPU
machine later. The GPU runner (benchmarks/gpu_run.py) builds the commands its jobs need."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p for folder in (BENCH, BENCH / "debug") for p in folder.glob("*.py"))


@pytest.fixture
def clean_imports(monkeypatch):
    """Scripts put their folders on sys.path and import their siblings by name: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if str(BENCH) in str(getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_script_imports(path, clean_imports):
    sys.path.insert(0, str(path.parent))  # as when run as a script: its own folder first
    name = f"_benchmark_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] == "triton":
            pytest.skip(f"{path.name} defines Triton kernels at import and triton is not installed "
                        "(its fsdp8 names are still checked by test_fsdp8_names_exist)")
        raise
    finally:
        del sys.modules[name]
    if "def main(" in path.read_text():
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.name} runs main() when imported"


# ----------------------------------------------------------------------------- fsdp8 names, read from source


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _bound(body: list) -> set[str]:
    """Names a module's top level binds, inside if / try / with blocks too."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names |= _bound(getattr(node, block, []))
    return names


def _names(module: str) -> set[str]:
    """What `module` offers: its top-level names and, for a package, its submodules."""
    path = _module_file(module)
    names = _bound(ast.parse(path.read_text()).body)
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")} | {p.parent.name for p in path.parent.glob("*/__init__.py")}
    return names


def _is_module(module: str) -> bool:
    return _module_file(module) is not None


def fsdp8_problems(path: Path) -> list[str]:
    """Every fsdp8 import of `path`, and every attribute read through a name bound to an fsdp8
    module (``fsdp8.X``, ``tk.X`` after ``from fsdp8.fp8 import triton_kernels as tk``), that
    the package's source does not define."""
    tree = ast.parse(path.read_text())
    problems, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fsdp8":
                    if not _is_module(a.name):
                        problems.append(f"line {node.lineno}: no module {a.name}")
                    aliases[a.asname or "fsdp8"] = a.name if a.asname else "fsdp8"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "fsdp8":
            if not _is_module(node.module):
                problems.append(f"line {node.lineno}: no module {node.module}")
                continue
            offered = _names(node.module)
            for a in node.names:
                if a.name not in offered:
                    problems.append(f"line {node.lineno}: {node.module} has no {a.name}")
                elif _is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):  # the outermost attribute of each chain: fsdp8.fp8.convert.make_fp8_primary
        if not isinstance(node, ast.Attribute) or not _chain(node) or _chain(node)[0] not in aliases:
            continue
        head, *attrs = _chain(node)
        module = aliases[head]
        for attr in attrs:
            if attr.startswith("__"):  # __file__, __version__: every module's
                break
            if attr not in _names(module):
                problems.append(f"line {node.lineno}: {module} has no {attr}")
                break
            if not _is_module(f"{module}.{attr}"):
                break  # an object of the module: its attributes are not checked
            module = f"{module}.{attr}"
    return sorted(set(problems))


def _chain(node: ast.Attribute) -> list[str]:
    """["a", "b", "c"] for a.b.c; [] where the chain does not start at a name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return [node.id, *reversed(attrs)] if isinstance(node, ast.Name) else []


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_fsdp8_names_exist(path):
    assert fsdp8_problems(path) == [], f"{path.relative_to(REPO)} uses fsdp8 names that are gone"


def test_name_check_finds_a_missing_name(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import fsdp8\nfrom fsdp8.fp8 import triton_kernels as tk\nfrom fsdp8.fp8.gemm import fp8_mm\n"
                      "def f():\n    from fsdp8.fp8.gemm import gone\n    return fsdp8.fully_shard, fsdp8.nothing, "
                      "tk._clamp_cast, tk.missing, fsdp8.fp8.convert.convert_to_fp8\n")
    assert fsdp8_problems(script) == ["line 5: fsdp8.fp8.gemm has no gone", "line 6: fsdp8 has no nothing",
                                      "line 6: fsdp8.fp8.triton_kernels has no missing"]


# ----------------------------------------------------------------------------- the GPU runner


def dry_run(*argv: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / "gpu_run.py"), *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_runner_peers_each_stack_in_its_own_process(tmp_path):
    out = dry_run("peers", "--dry-run", "--out", str(tmp_path), "--wheels", "none", "--models", "A,B",
                  "--stacks", "fsdp8,fsdp8-fp8-current", "--compile", "both", "--loopback", "2", "--", "--skip-packed-check")
    runs = [line for line in out.splitlines() if "peers.py" in line]
    assert len(runs) == 8  # 2 models x 2 stacks x eager and compiled
    assert "--stacks fsdp8-fp8-current-compile" in runs[3] and "--models A" in runs[3]
    assert all("--loopback-world 2" in r and r.rstrip().split("#")[0].count("--skip-packed-check") == 1 for r in runs)


def test_runner_binds_every_torchrun_to_its_gpus_numa_node_when_asked(tmp_path):
    args = ("--dry-run", "--out", str(tmp_path), "--wheels", "none", "--stacks", "fsdp8,fsdp8-tp-compile")
    bound = [line for line in dry_run("peers", *args, "--numa-binding", "node").splitlines() if "peers.py" in line]
    plain = [line for line in dry_run("peers", *args).splitlines() if "peers.py" in line]
    assert len(bound) == len(plain) == 2
    assert all("torch.distributed.run --numa-binding node --nproc_per_node" in r for r in bound)
    assert not any("--numa-binding" in r for r in plain)


def test_runner_ab_runs_old_new_new_old(tmp_path):
    out = dry_run("ab", "--dry-run", "--out", str(tmp_path), "--wheels", "none", "--old", "HEAD~1")
    runs = [line for line in out.splitlines() if "peers.py" in line]
    assert [r.split("--out ")[1].split()[0].rsplit("/", 1)[1] for r in runs] == [
        "ab-1-old.json", "ab-2-new.json", "ab-3-new.json", "ab-4-old.json"]
    assert all("--models B --stacks fsdp8-fp8-current-compile" in r and "--nproc_per_node 1" in r for r in runs)


def test_runner_suite_and_plan_commands(tmp_path):
    suite = dry_run("suite", "--dry-run", "--out", str(tmp_path), "--wheels", "none", "--worlds", "1,4")
    assert "FSDP8_TEST_BACKEND=nccl" in suite and "FSDP8_TEST_WORLDS=1,4" in suite and "tests/dist tests/gpu" in suite
    plan = dry_run("plan", "--dry-run", "--out", str(tmp_path), "--wheels", "none", "--models", "A", "--ac", "full",
                   "--", "--tp", "2")
    world1, world2 = [line for line in plan.splitlines() if line.startswith("$")]
    assert "-m fsdp8 bench --nproc 1" in world1 and "bench_loopback.py --world 2" in world2
    assert world2.split(">")[0].rstrip().endswith("--json --tp 2")


def test_runner_sets_multicast_off(clean_imports):
    sys.path.insert(0, str(BENCH))
    import gpu_run

    args = gpu_run.parser().parse_args(["sync", "--out", "/nonexistent", "--dry-run"])
    env = gpu_run.Session(args).env
    assert {k: env[k] for k in gpu_run.MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_peers_skip_the_packed_sequence_check_unless_asked(clean_imports):
    # Its batches are never packed, so every stack skips transformers' per-forward host sync by
    # default (a run without it measured each stack with one sync a step); --packed-check keeps it.
    sys.path.insert(0, str(BENCH))
    import moe_peers
    import peers

    for parse in (peers.parse_args, moe_peers.parse_args):
        assert parse([]).skip_packed_check is True
        assert parse(["--skip-packed-check"]).skip_packed_check is True
        assert parse(["--packed-check"]).skip_packed_check is False


def test_collect_in_step_collects_on_schedule_and_restores_the_collector(clean_imports, monkeypatch):
    import gc

    sys.path.insert(0, str(BENCH))
    from gc_in_step import CollectInStep

    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    assert gc.isenabled()
    with CollectInStep(every=3) as collector:
        assert not gc.isenabled() and calls == [2]  # a clean start, then no automatic collection
        collected = [collector.step() for _ in range(7)]
    assert collected == [False, False, True, False, False, True, False]
    assert calls == [2, 1, 1, 2] and gc.isenabled()  # generation 1 on steps 3 and 6, a full one on exit
    gc.disable()
    try:
        with CollectInStep(every=2):
            pass
        assert not gc.isenabled()  # the state it found is the state it leaves
    finally:
        gc.enable()
    with CollectInStep(every=0) as off:  # 0: Python's own collector, untouched
        assert gc.isenabled() and not off.step()
    with pytest.raises(ValueError, match="every must be >= 0"):
        CollectInStep(every=-1)
