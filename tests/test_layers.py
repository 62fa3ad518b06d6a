"""The packages' layering, as pyproject.toml's import-linter contracts state it: a lower package
never imports a higher one, even through a function-level import; inside the library, its parts
(formats, kernels, model, config, sparsity, engine, then the API) likewise, and no part's modules
import one another in a circle."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_packages_keep_their_layers():
    r = lint_imports("--no-cache")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "3 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_a_back_edge_is_caught(tmp_path):
    # the same contracts over a copy of the library with one import that breaks them: the
    # check fails, naming the import (a contract that cannot fail would prove nothing)
    import shutil
    for pkg in ("serve_app", "actors", "cluster", "powerinfer"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns(
            "__pycache__", "_ext", "csrc"))
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    with open(tmp_path / "powerinfer" / "errors.py", "a") as f:
        f.write("\n\ndef _back_edge():\n    from actors import handle  # noqa: F401\n")
    # a file format reaching up into the engine, and two modules of one part in a circle
    with open(tmp_path / "powerinfer" / "formats" / "bundle.py", "a") as f:
        f.write("\n\ndef _back_edge():\n    from ..engine import budget  # noqa: F401\n")
    with open(tmp_path / "powerinfer" / "engine" / "kv.py", "a") as f:
        f.write("\n\ndef _circle():\n    from . import batching  # noqa: F401\n")
    exe = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(exe), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "powerinfer.errors -> actors.handle" in r.stdout, r.stdout[-3000:]
    assert "powerinfer.formats.bundle -> powerinfer.engine.budget" in r.stdout, r.stdout[-3000:]
    assert "0 kept, 3 broken" in r.stdout and ".kv -> .batching" in r.stdout, r.stdout[-3000:]


def test_the_front_imports_no_engine():
    # what a process that only forwards requests loads: the Serve ingress, the `powerinfer serve`
    # driver (its command line, the app and its models' configurations), the caller's side of a
    # stream the ingress runs, and the scheduler's actor class (Ray imports the class's module wherever
    # a handle to the actor arrives: the ingress holds the scheduler's) import neither torch nor
    # the placement solver's scipy, nor the library's API, the package's `__init__` included;
    # the scheduler's work (in its own process: the batching core, sampling, grammar masks)
    # imports neither torch nor the solver; nor does a served model's replica (it tokenizes and
    # starts and supervises its actor group: the executors' classes it makes actors of are
    # `actors.roles`' facades, and what the group is built from is decided in a task)
    code = ("import sys\n"
            "import serve_app.ingress, serve_app.app, serve_app.server, powerinfer.cli\n"
            "import actors.follow, actors.scheduler, powerinfer\n"
            "from powerinfer.config import Config\n"
            "Config(dtype='bf16', cpu_isa='avx2')\n"
            "bad = [m for m in ('torch', 'scipy', 'powerinfer.api') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "import actors.batch_loop\n"
            "assert 'scipy' not in sys.modules and 'torch' not in sys.modules\n"
            "import serve_app.model, actors.handle, actors.group, actors.roles, actors.prepare\n"
            "assert 'scipy' not in sys.modules and 'torch' not in sys.modules\n"
            "from powerinfer import PowerInfer, SamplingParams\n"  # (still there, when asked for)
            "assert 'powerinfer.api' in sys.modules and SamplingParams.__module__.endswith('params')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
