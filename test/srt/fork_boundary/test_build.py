"""The fork builds and installs as the `sglang` distribution: valid, deterministic,
every patch applied, every hook registered and applied, bad inputs named."""

import csv
import hashlib
import base64
import io
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from fork_build import BuildError, backend
from fork_build.lock import read_lock
from fork_build.patchqueue import git, read_series
from fork_build.upstream import select_tag, upstream_wheel

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
LOCK = read_lock(ROOT)
SOURCES = ("pyproject.toml", "upstream.lock", "patches", "python", "build_backend")


def copy_root(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def upstream_whl() -> Path:
    return upstream_wheel(LOCK, select_tag(LOCK))


@pytest.fixture(scope="module")
def fork_whl(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    return out / backend.build_wheel(str(out))


@pytest.fixture
def root_copy(tmp_path) -> Path:
    return copy_root(tmp_path / "fork")


def _b64sha(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_wheel_name_version_and_requirements(fork_whl, upstream_whl):
    tag = select_tag(LOCK)
    assert fork_whl.name == f"sglang-{LOCK.version}+{LOCK.local}-{tag}.whl"
    with zipfile.ZipFile(fork_whl) as zf, zipfile.ZipFile(upstream_whl) as up:
        meta = zf.read(f"sglang-{LOCK.fork_version}.dist-info/METADATA").decode()
        up_meta = up.read(f"sglang-{LOCK.version}.dist-info/METADATA").decode()
        version_py = zf.read("sglang/_version.py").decode()
    assert re.search(r"^Name: sglang$", meta, re.M)
    assert re.search(rf"^Version: {re.escape(LOCK.fork_version)}$", meta, re.M)
    requires = lambda m: [l for l in m.splitlines() if l.startswith("Requires-Dist:")]
    assert requires(meta) == requires(up_meta) and len(requires(meta)) > 50
    assert f"__version__ = version = '{LOCK.fork_version}'" in version_py


def test_every_record_hash_checks_out(fork_whl):
    with zipfile.ZipFile(fork_whl) as zf:
        record_name = f"sglang-{LOCK.fork_version}.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        names = {i.filename for i in zf.infolist()}
        assert {r[0] for r in rows} == names
        for path, digest, size in rows:
            if path == record_name:
                assert digest == size == ""
                continue
            data = zf.read(path)
            assert digest == _b64sha(data), path
            assert int(size) == len(data), path


def test_every_patch_applied_and_nothing_else_changed(fork_whl, upstream_whl, tmp_path):
    """Reverse-applying the series, last patch first, on the wheel's tree must give back
    upstream exactly: each patch is in the wheel, and nothing else differs."""
    patches = read_series(ROOT)
    assert patches, "the series is empty"
    tree = tmp_path / "tree"
    overlays = {f"sglang/{p.relative_to(ROOT / 'python' / 'sglang').as_posix()}"
                for p in (ROOT / "python" / "sglang").rglob("*.py")}
    with zipfile.ZipFile(fork_whl) as zf:
        for name in zf.namelist():
            if ".dist-info/" in name or name in overlays or name == "sglang/_version.py":
                continue
            (tree / "python" / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / "python" / name).write_bytes(zf.read(name))
    git(tree, "init", "-q")
    for patch in reversed(patches):
        proc = git(tree, "apply", "-R", "--check", str(patch), check=False)
        assert proc.returncode == 0, f"{patch.name} is not applied in the wheel: {proc.stderr}"
        git(tree, "apply", "-R", str(patch))
    with zipfile.ZipFile(upstream_whl) as up:
        expected = {n: up.read(n) for n in up.namelist()
                    if ".dist-info/" not in n and not n.endswith("/") and n != "sglang/_version.py"}
    got = {p.relative_to(tree / "python").as_posix(): p.read_bytes()
           for p in (tree / "python").rglob("*") if p.is_file()}
    assert got.keys() == expected.keys()
    assert [n for n in expected if got[n] != expected[n]] == []


def test_overlay_files_shipped_verbatim(fork_whl):
    with zipfile.ZipFile(fork_whl) as zf:
        for path in (ROOT / "python").rglob("*.py"):
            rel = path.relative_to(ROOT / "python").as_posix()
            assert zf.read(rel) == path.read_bytes(), rel


def test_plugin_entry_point_declared(fork_whl):
    with zipfile.ZipFile(fork_whl) as zf:
        eps = zf.read(f"sglang-{LOCK.fork_version}.dist-info/entry_points.txt").decode()
    assert "[sglang.srt.plugins]\nsglang_pd_fork = sglang.srt.managers.fork_core.fork_plugin:register" in eps
    assert "[console_scripts]" in eps  # upstream's entry points kept


def test_hooks_registered_and_applied_in_installed_sglang():
    """Upstream only logs a hook that fails: load the plugins the installed
    distribution declares and require each of our hooks to have patched its target."""
    code = (
        "from importlib.metadata import entry_points, version\n"
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.managers.fork_core import fork_plugin\n"
        "eps = [e.value for e in entry_points(group='sglang.srt.plugins')]\n"
        "assert eps == ['sglang.srt.managers.fork_core.fork_plugin:register'], eps\n"
        "load_plugins()\n"
        "applied = fork_plugin.hooks_applied()\n"
        "assert applied and all(applied.values()), applied\n"
        "print(version('sglang'), len(applied))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == LOCK.fork_version


def test_build_is_deterministic(fork_whl, tmp_path):
    again = tmp_path / backend.build_wheel(str(tmp_path))
    assert again.read_bytes() == fork_whl.read_bytes()


def test_python_m_build_sdist_then_wheel_gives_same_wheel(fork_whl, root_copy, tmp_path):
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(root_copy)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / f"sglang-{LOCK.fork_version}.tar.gz").is_file()
    assert (out / fork_whl.name).read_bytes() == fork_whl.read_bytes()


def _install_into_fresh_venv(path: Path, *pip_args: str) -> Path:
    """A new venv with `pip install --no-deps *pip_args`; afterwards it also sees this
    interpreter's packages, *after* its own, so `import sglang` finds the sglang
    installed into it and upstream's runtime deps resolve. --no-compile: pip's
    byte-compiling of the ~4700 modules is three quarters of the install's CPU and
    never fails an install (pip only logs a module that does not compile); what the
    probe imports is compiled when imported."""
    venv.EnvBuilder(with_pip=False).create(path)
    py = path / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                           "--no-compile", *pip_args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "zz_runtime_deps.pth").write_text("\n".join(deps) + "\n")
    return py


PROBE = (
    "import importlib.metadata as md, sglang, sglang.srt.managers.fork_core.fork_plugin as fp\n"
    "print(md.version('sglang')); print(sglang.__version__); print(sglang.__file__); print(fp.__file__)\n"
)


def test_install_wheel_into_fresh_venv(fork_whl, tmp_path):
    py = _install_into_fresh_venv(tmp_path / "venv", str(fork_whl))
    dist_version, version, init, plugin = subprocess.check_output([py, "-c", PROBE], text=True).split()
    assert dist_version == version == LOCK.fork_version
    assert init.startswith(str(tmp_path / "venv")) and plugin.startswith(str(tmp_path / "venv"))


def test_editable_install_uses_patch_queue_checkout(root_copy, tmp_path):
    py = _install_into_fresh_venv(tmp_path / "venv", "-e", str(root_copy))
    dist_version, version, init, plugin = subprocess.check_output([py, "-c", PROBE], text=True).split()
    upstream = root_copy / ".upstream"
    assert dist_version == version == LOCK.fork_version
    assert init == str(upstream / "python" / "sglang" / "__init__.py")
    assert Path(plugin).resolve() == (root_copy / "python/sglang/srt/managers/fork_core/fork_plugin.py").resolve()
    subjects = git(upstream, "log", "--format=%s", f"upstream/{LOCK.version}..patch-queue").stdout.split("\n")[:-1]
    assert len(subjects) == len(read_series(root_copy))
    assert git(upstream, "status", "--porcelain").stdout == ""


# --- bad input: each fails the build with a message naming the culprit ---

def _build_error(root: Path, tmp_path: Path) -> str:
    with pytest.raises(BuildError) as e:
        backend.build_wheel(str(tmp_path), root=root)
    return str(e.value)


def test_wrong_sha256_in_lock(root_copy, tmp_path):
    tag = select_tag(LOCK)
    lock = root_copy / "upstream.lock"
    lock.write_text(lock.read_text().replace(LOCK.wheels[tag], "0" * 64))
    msg = _build_error(root_copy, tmp_path)
    assert f"sha256 mismatch for sglang-{LOCK.version}-{tag}.whl" in msg and "0" * 64 in msg


def test_broken_patch_named_with_file_and_hunk(root_copy, tmp_path):
    first = read_series(root_copy)[0]
    text = first.read_text()
    hunk = re.search(r"^@@ -\d+.*\n((?:[ +\-].*\n)+)", text, re.M)
    file = re.findall(r"^diff --git a/\S+ b/(\S+)", text[: hunk.start()], re.M)[-1]
    context = next(l for l in hunk.group(1).splitlines() if l.startswith(" ") and l.strip())
    broken = hunk.group(1).replace(context, " # context that is not upstream's", 1)
    first.write_text(text[: hunk.start(1)] + broken + text[hunk.end(1):])
    msg = _build_error(root_copy, tmp_path)
    assert f"patch {first.name} does not apply: {file}, hunk 1/" in msg


def test_patch_missing_from_series(root_copy, tmp_path):
    (root_copy / "patches" / "stray.patch").write_text("Why: x\nUpstream-Status: x\n---\n")
    assert "patches/stray.patch is not listed in patches/series" in _build_error(root_copy, tmp_path)


def test_series_names_missing_patch(root_copy, tmp_path):
    with open(root_copy / "patches" / "series", "a") as f:
        f.write("no-such.patch\n")
    assert "patches/series lists no-such.patch, which does not exist" in _build_error(root_copy, tmp_path)


def test_patch_without_upstream_status(root_copy, tmp_path):
    first = read_series(root_copy)[0]
    first.write_text(re.sub(r"^Upstream-Status:.*\n", "", first.read_text(), flags=re.M))
    assert f"patches/{first.name}: header 'Upstream-Status:' missing" in _build_error(root_copy, tmp_path)


def test_overlay_may_not_replace_upstream_file(root_copy, tmp_path):
    (root_copy / "python" / "sglang" / "version.py").write_text("__version__ = 'x'\n")
    assert "python/sglang/version.py would replace an upstream file" in _build_error(root_copy, tmp_path)


@pytest.mark.parametrize("python,machine,glibc", [((3, 10), "x86_64", (2, 36)),
                                                  ((3, 11), "riscv64", (2, 36)),
                                                  ((3, 12), "x86_64", (2, 28)),
                                                  ((3, 11), "x86_64", None)])
def test_unsupported_platform_or_python(python, machine, glibc):
    with pytest.raises(BuildError, match=r"unsupported platform or Python: cpython 3\.\d+ on \w+") as e:
        select_tag(LOCK, python=python, machine=machine, glibc=glibc or ())
    assert "cp311-cp311-manylinux_2_34_x86_64" in str(e.value)


@pytest.mark.parametrize("python,machine", [((3, 11), "x86_64"), ((3, 13), "aarch64")])
def test_supported_tags_selected(python, machine):
    assert select_tag(LOCK, python=python, machine=machine, glibc=(2, 36)) == \
        f"cp{python[0]}{python[1]}-cp{python[0]}{python[1]}-manylinux_2_34_{machine}"
