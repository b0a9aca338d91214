"""tools/fork: the patch queue's round trip, `check`, `status`, and the rebase proof.

A small series is authored against upstream 0.5.22 with the tool itself (`pq import`,
commits in .upstream/ by a developer identity, `pq export`); `tools/fork rebase 0.5.23`
then moves it. Clean series: the result applies, the fork wheel builds, and the patched
modules compile and import. Conflicting series: the conflict is named by patch, file
and hunk, nothing in the repository changes, and the documented resume works.
One wheel tag (this interpreter's) keeps the proof's runtime modest; the real series
stays on 0.5.23 (these tests only touch copies of the repository).
"""

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from fork_build import backend
from fork_build.lock import read_lock
from fork_build.patchqueue import git, read_series
from fork_build.upstream import select_tag

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "tools" / "fork"
LOCK = read_lock(ROOT)
TAG = select_tag(LOCK)
OLD, NEW = "0.5.22", LOCK.version
# sha256 of upstream's 0.5.22 wheels as published (immutable); other tags are fetched to learn it.
OLD_SHA256 = {"cp311-cp311-manylinux_2_34_x86_64": "cc9a0f15bd8f877a0584fdb7a1702240177a1f1cc8d17c978715161717b9037b"}
CHOICES = "python/sglang/srt/arg_groups/choices.py"
UTILS = "python/sglang/srt/disaggregation/common/utils.py"
DEV = {"GIT_AUTHOR_NAME": "Dev Eloper", "GIT_AUTHOR_EMAIL": "dev@example.invalid",
       "GIT_COMMITTER_NAME": "Dev Eloper", "GIT_COMMITTER_EMAIL": "dev@example.invalid",
       "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_EDITOR": "true"}

# The proof series: (subject, file, old text, new text, message body).
ADD_CONSTANT = (
    "arg_groups/choices: name the transfer backends the fork hardens", CHOICES,
    "add_disagg_transfer_backend_choices = DISAGG_TRANSFER_BACKEND_CHOICES.extend\n",
    "add_disagg_transfer_backend_choices = DISAGG_TRANSFER_BACKEND_CHOICES.extend\n\n"
    "# Fork: transfer backends the PD fork is hardened for.\n"
    'FORK_HARDENED_TRANSFER_BACKENDS = ("mooncake",)\n',
    "Why: the proof series for tools/fork needs a patch in a region upstream moved.\n"
    "What: one constant.\nUpstream-Status: not for upstream (test fixture).",
)
MARK_LINE = (  # upstream 0.5.23 rewrote this very line: the conflict
    "arg_groups/choices: mark tokenspeed_mla as kept", CHOICES,
    '    "tokenspeed_mla",\n    "trtllm_mha",\n',
    '    "tokenspeed_mla",  # fork: kept for PD prefill\n    "trtllm_mha",\n',
    "Why: a patch on a line upstream changed in 0.5.23.\nUpstream-Status: not for upstream (test fixture).",
)
COMMENT_UTILS = (
    "disaggregation/common/utils: comment pack_list_of_buffers", UTILS,
    "    if not buffers:\n        return b\"\"\n",
    "    # fork: an empty list packs to nothing\n    if not buffers:\n        return b\"\"\n",
    "Why: a patch below a line upstream removed in 0.5.23.\n"
    "What: a comment.\nUpstream-Status: not for upstream (test fixture).",
)
SERIES_HEADER = "# The fork's patch series, applied in order.\n\n"


def fork(root: Path, *args: str, ok: bool | None = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(TOOL), "--root", str(root), *args],
                          capture_output=True, text=True, timeout=900)
    if ok is not None:
        assert (proc.returncode == 0) == ok, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def dev_git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          env={**os.environ, **DEV})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def commit(repo: Path, change) -> None:
    subject, path, old, new, body = change
    text = (repo / path).read_text()
    assert text.count(old) == 1, (path, old)
    (repo / path).write_text(text.replace(old, new))
    dev_git(repo, "add", path)
    dev_git(repo, "commit", "-q", "-m", subject, "-m", body)


def series(root: Path) -> list[str]:
    return [p.name for p in read_series(root)]


def patch_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "patches").iterdir()}


def hunk_headers(patch: Path) -> list[str]:
    return re.findall(r"(?m)^(@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@)", patch.read_text())


def old_sha256(tmp: Path) -> str:
    if TAG in OLD_SHA256:
        return OLD_SHA256[TAG]
    interp, abi, plat = TAG.split("-")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--platform", plat, "--implementation", "cp", "--abi", abi,
                    "--python-version", f"{interp[2]}.{interp[3:]}", "--dest", str(tmp),
                    f"sglang=={OLD}"], check=True, capture_output=True)
    return hashlib.sha256(next(tmp.glob("*.whl")).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def authored(tmp_path_factory) -> Path:
    """A repository copy locked to upstream 0.5.22 (label fork.3) whose three patches
    were written in .upstream/ and exported by the tool."""
    root = tmp_path_factory.mktemp("authored") / "fork"
    root.mkdir()
    for name in ("pyproject.toml", ".gitignore", "build_backend", "python"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, root / name)
    lock = (ROOT / "upstream.lock").read_text()
    lock = lock.replace(f'version = "{NEW}"', f'version = "{OLD}"').replace(f'local = "{LOCK.local}"', 'local = "fork.3"')
    lock = re.sub(r'(?m)^"cp.*\n', "", lock).replace(
        "[wheels]\n", f'[wheels]\n"{TAG}" = "{old_sha256(tmp_path_factory.mktemp("old"))}"\n')
    (root / "upstream.lock").write_text(lock)
    (root / "CHANGELOG.md").write_text(
        "# Changelog\n\nIntro.\n\n## 0.5.22+fork.3 — based on upstream sglang 0.5.22\n\n- Earlier work.\n")
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text(SERIES_HEADER)

    assert f".upstream/: upstream/{OLD} + patch-queue (0 patches)" in fork(root, "pq", "import").stdout
    assert git(root / ".upstream", "config", "gc.autoDetach").stdout == "false\n"  # copies race no gc
    for change in (ADD_CONSTANT, MARK_LINE, COMMENT_UTILS):
        commit(root / ".upstream", change)
    fork(root, "pq", "export")
    return root


@pytest.fixture
def repo_copy(authored, tmp_path) -> Path:
    dest = tmp_path / "fork"
    shutil.copytree(authored, dest, symlinks=True)
    return dest


NAMES = ["arg_groups-choices-name-the-transfer-backends-the-fo.patch",
         "arg_groups-choices-mark-tokenspeed_mla-as-kept.patch",
         "disaggregation-common-utils-comment-pack_list_of_buf.patch"]


def test_export_pins_identity_and_keeps_series_in_order(repo_copy):
    root = repo_copy
    names = series(root)
    assert names == NAMES
    assert (root / "patches" / "series").read_text() == SERIES_HEADER + "".join(n + "\n" for n in names)
    for name, (subject, *_rest, body) in zip(names, (ADD_CONSTANT, MARK_LINE, COMMENT_UTILS)):
        text = (root / "patches" / name).read_text()
        # the developer's identity and date are pinned, the subject kept as written
        assert text.startswith(
            "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: sglang-pd-fork <fork@sglang-pd.invalid>\n"
            "Date: Thu, 1 Jan 2026 00:00:00 +0000\n"
            f"Subject: {subject}\n\n{body}\n"), text[:400]
        assert "Dev Eloper" not in text and re.search(r"(?m)^index [0-9a-f]{40}\.\.[0-9a-f]{40}", text)


def test_export_with_nothing_changed_writes_nothing(repo_copy):
    root = repo_copy
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (root / "patches").iterdir()}
    out = fork(root, "pq", "export").stdout
    assert "nothing changed" in out and "series unchanged" in out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (root / "patches").iterdir()} == before


def test_fresh_import_reexports_byte_for_byte(repo_copy):
    root, repo = repo_copy, repo_copy / ".upstream"
    before = patch_bytes(root)
    fork(root, "pq", "import", "--force")
    assert git(repo, "log", "--format=%an", "-1").stdout.strip() == "sglang-pd-fork"
    assert "nothing changed" in fork(root, "pq", "export").stdout
    assert patch_bytes(root) == before


def test_export_of_a_renamed_patch_keeps_its_place(repo_copy):
    root, repo = repo_copy, repo_copy / ".upstream"
    before = patch_bytes(root)
    dev_git(repo, "checkout", "-q", "--detach", "patch-queue~1")
    dev_git(repo, "commit", "-q", "--amend", "-m", "arg_groups/choices: keep tokenspeed_mla",
            "-m", "Why: x.\nUpstream-Status: no.")
    dev_git(repo, "cherry-pick", "patch-queue")
    dev_git(repo, "branch", "-f", "patch-queue", "HEAD")
    dev_git(repo, "checkout", "-q", "patch-queue")
    out = fork(root, "pq", "export").stdout
    # the stale file removed, the series keeps its place and the header comment
    assert "removed arg_groups-choices-mark-tokenspeed_mla-as-kept.patch" in out, out
    assert series(root) == [NAMES[0], "arg_groups-choices-keep-tokenspeed_mla.patch", NAMES[2]]
    assert (root / "patches" / "series").read_text().startswith(SERIES_HEADER)
    assert sorted(p.name for p in (root / "patches").glob("*.patch")) == sorted(series(root))
    assert patch_bytes(root)[NAMES[2]] == before[NAMES[2]]  # untouched neighbour


def test_export_refuses_a_commit_without_headers(repo_copy):
    root, repo = repo_copy, repo_copy / ".upstream"
    snapshot = patch_bytes(root)
    (repo / UTILS).write_text((repo / UTILS).read_text() + "# more\n")
    dev_git(repo, "commit", "-q", "-am", "no headers", "-m", "Why: only this.")
    proc = fork(root, "pq", "export", ok=False)
    assert "commit 'no headers' (no-headers.patch) lacks the 'Upstream-Status:' header" in proc.stderr
    assert patch_bytes(root) == snapshot


def test_import_force_refuses_work_not_in_patches(repo_copy):
    root, repo = repo_copy, repo_copy / ".upstream"
    assert "already holds upstream/0.5.22" in fork(root, "pq", "import").stdout

    (repo / UTILS).write_text((repo / UTILS).read_text() + "# an edit\n")
    proc = fork(root, "pq", "import", "--force", ok=False)
    assert "uncommitted edits in .upstream/: " + UTILS in proc.stderr, proc.stderr
    assert (repo / UTILS).read_text().endswith("# an edit\n")  # left alone

    dev_git(repo, "commit", "-q", "-am", "utils: an edit", "-m", "Why: w.\nUpstream-Status: no.")
    proc = fork(root, "pq", "import", "--force", ok=False)
    assert "patch-queue has commits not exported to patches/" in proc.stderr, proc.stderr

    fork(root, "pq", "export")
    assert series(root)[-1] == "utils-an-edit.patch"
    fork(root, "pq", "import", "--force")
    assert git(repo, "log", "--format=%s", f"upstream/{OLD}..patch-queue").stdout.splitlines()[0] == "utils: an edit"
    assert git(repo, "status", "--porcelain").stdout == ""


def test_rebase_clean_series_applies_builds_imports(repo_copy, tmp_path):
    root, repo = repo_copy, repo_copy / ".upstream"
    # the clean series: drop the patch that conflicts, then re-import what patches/ says
    conflicting = series(root)[1]
    (root / "patches" / conflicting).unlink()
    (root / "patches" / "series").write_text((root / "patches" / "series").read_text().replace(conflicting + "\n", ""))
    fork(root, "pq", "import", "--force")
    before = patch_bytes(root)
    headers_before = {n: hunk_headers(root / "patches" / n) for n in series(root)}

    out = fork(root, "rebase", NEW).stdout
    assert f"rebased 2 patches from upstream {OLD} onto {NEW}" in out, out

    lock = read_lock(root)  # new version, label reset, sha256 fetched through pip
    assert (lock.version, lock.local, lock.wheels) == (NEW, "fork.1", {TAG: LOCK.wheels[TAG]})
    assert (root / "upstream.lock").read_text().startswith("# The upstream sglang release")
    names = series(root)
    assert names == list(headers_before)
    for name in names:  # refreshed for the moved lines; nothing else in the file changed
        assert patch_bytes(root)[name] != before[name]
        assert hunk_headers(root / "patches" / name) != headers_before[name]
    changelog = (root / "CHANGELOG.md").read_text()
    assert changelog.index(f"## {NEW}+fork.1 (unreleased) — based on upstream sglang {NEW}") \
        < changelog.index("## 0.5.22+fork.3")
    assert f"- Rebased from upstream sglang {OLD} onto {NEW} with `tools/fork rebase`" in changelog
    assert "Patches refreshed (context or line numbers moved): " + ", ".join(f"`{n}`" for n in names) in changelog

    # upstream tracked as a branch: the new release on top of the old, the queue on top
    assert git(repo, "rev-parse", f"upstream/{NEW}^").stdout == git(repo, "rev-parse", f"upstream/{OLD}").stdout
    assert git(repo, "log", "--format=%s", f"upstream/{NEW}..patch-queue").stdout.count("\n") == 2
    assert "nothing changed" in fork(root, "pq", "export").stdout

    # builds: the in-tree backend replays the refreshed series with git am (exact context)
    wheel = tmp_path / backend.build_wheel(str(tmp_path), root=root)
    assert wheel.name == f"sglang-{NEW}+fork.1-{TAG}.whl"
    # imports: both patched modules compile; choices.py (standard library only) is
    # imported and has both the fork's constant and upstream's 0.5.23 change
    tree = tmp_path / "tree"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree, [m[len("python/"):] for m in (CHOICES, UTILS)])
    code = (
        "import importlib.util, py_compile, sys\n"
        "for p in sys.argv[1:]: py_compile.compile(p, doraise=True)\n"
        "spec = importlib.util.spec_from_file_location('choices', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.FORK_HARDENED_TRANSFER_BACKENDS, 'tokenspeed_mla' in m.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tree / CHOICES[7:]), str(tree / UTILS[7:])],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "('mooncake',) False"  # 0.5.22 listed tokenspeed_mla there
    assert "# fork: an empty list packs to nothing" in (tree / UTILS[7:]).read_text()

    # and the rebased fork passes the CI checks for its one tag
    out = fork(root, "check").stdout
    assert "check: ok (1 tags)" in out, out


def test_rebase_conflict_reported_precisely_and_resumable(repo_copy, tmp_path):
    root, repo = repo_copy, repo_copy / ".upstream"
    pristine = tmp_path / "again"
    shutil.copytree(root, pristine, symlinks=True)
    names = series(root)
    kept = {n: (root / n).read_bytes() for n in ("upstream.lock", "CHANGELOG.md")}
    before, tip = patch_bytes(root), git(repo, "rev-parse", "patch-queue").stdout
    hunk = hunk_headers(root / "patches" / names[1])
    assert len(hunk) == 1

    def conflicted():
        proc = fork(root, "rebase", NEW, ok=False)
        assert proc.returncode == 1
        lines = proc.stdout.splitlines()
        start = lines.index(next(l for l in lines if l.startswith("conflict:")))
        assert lines[start] == (f"conflict: patch 2/3 {names[1]} ('{MARK_LINE[0]}') does not apply "
                                f"to upstream {NEW}:")
        assert lines[start + 1:start + 3] == [f"  {CHOICES}: hunk 1/1 ({hunk[0]})", ""]
        assert "git -C .upstream rebase --continue" in proc.stdout and "tools/fork pq export" in proc.stdout
        # nothing in the repository changed
        assert patch_bytes(root) == before
        assert {n: (root / n).read_bytes() for n in kept} == kept
        # the tree is stopped mid-rebase on that patch, with the conflict in place
        assert "rebase in progress" in dev_git(repo, "status")
        assert git(repo, "diff", "--name-only", "--diff-filter=U").stdout.split() == [CHOICES]
        assert "<<<<<<< " in (repo / CHOICES).read_text()

    conflicted()
    # export refuses while the rebase is stopped
    assert "a git rebase is in progress" in fork(root, "pq", "export", ok=False).stderr

    # give up: everything as before
    fork(root, "rebase", "--abort")
    assert git(repo, "rev-parse", "patch-queue").stdout == tip
    assert "in sync with patches/" in fork(root, "status").stdout

    # again, and this time resolve it the documented way
    conflicted()
    text = (repo / CHOICES).read_text()
    resolved = '    "tokenspeed_mla",  # Deprecated alias for "cutedsl_mla"; fork: kept for PD prefill\n'
    (repo / CHOICES).write_text(re.sub(r"<<<<<<< .*?>>>>>>> [^\n]*\n", resolved, text, count=1, flags=re.S))
    dev_git(repo, "add", CHOICES)
    dev_git(repo, "rebase", "--continue")
    out = fork(root, "pq", "export").stdout
    assert f"rebased 3 patches from upstream {OLD} onto {NEW}" in out, out

    assert series(root) == names
    assert "+" + resolved in (root / "patches" / names[1]).read_text()
    lock = read_lock(root)
    assert (lock.version, lock.local, lock.wheels) == (NEW, "fork.1", {TAG: LOCK.wheels[TAG]})
    assert f"## {NEW}+fork.1 (unreleased)" in (root / "CHANGELOG.md").read_text()
    # rerere kept the resolution: the same rebase redone elsewhere needs no help
    shutil.copytree(repo / ".git" / "rr-cache", pristine / ".upstream" / ".git" / "rr-cache",
                    dirs_exist_ok=True)
    out = fork(pristine, "rebase", NEW).stdout
    assert "rerere reused a recorded resolution; continuing" in out, out
    assert patch_bytes(pristine) == patch_bytes(root)
    # the result applies to upstream 0.5.23 with exact context
    scratch = root / "scratch"
    scratch.mkdir()
    backend.prepare_patched_repo(root, scratch)
    assert resolved in (scratch / CHOICES).read_text()


def test_check_names_each_failure(repo_copy):
    root = repo_copy
    plugin = root / "python/sglang/srt/managers/fork_core/fork_plugin.py"
    plugin.write_text(plugin.read_text().replace("SchedulerInternalStateController.get_internal_state",
                                                 "SchedulerInternalStateController.no_such_method"))
    (root / "python/sglang/srt/managers/copied_utils.py").write_bytes(subprocess.run(
        ["git", "-C", str(root / ".upstream"), "show", f"upstream/{OLD}:{UTILS}"],
        capture_output=True, check=True).stdout)
    first = root / "patches" / series(root)[0]
    header = hunk_headers(first)[0]
    drifted = re.sub(r"-(\d+)", lambda m: f"-{int(m.group(1)) - 2}", header, count=1)
    first.write_text(first.read_text().replace(header, drifted))  # applies at an offset

    proc = fork(root, "check", ok=False)
    out = proc.stdout
    assert "ok   series lint: 3 patches" in out
    assert f"ok   apply to {TAG}: all 3 patches apply" in out
    assert f"FAIL re-export: re-export is not byte-identical for {first.name}" in out
    # on the plugin hooks line, among the targets 0.5.22 lacks (named in HOOKS' order, sorted by target)
    assert re.search(r"(?m)^FAIL plugin hooks: (.*; )?target sglang\.srt\.managers\.scheduler_components\.internal_state\."
                     rf"SchedulerInternalStateController\.no_such_method does not exist in upstream {OLD}", out), out
    assert "FAIL no upstream copies: python/sglang/srt/managers/copied_utils.py: identical to an upstream file" in out
    assert "check: FAILED (re-export, plugin hooks, no upstream copies)" in out

    (root / "patches" / "series").write_text((root / "patches" / "series").read_text() + "gone.patch\n")
    assert "FAIL series lint: patches/series lists gone.patch" in fork(root, "check", ok=False).stdout


def test_status_one_line_per_patch_and_hook(repo_copy):
    lines = fork(repo_copy, "status").stdout.splitlines()
    assert [l.split(":")[0] for l in lines if l.startswith("patch ")] == [f"patch {n}" for n in series(repo_copy)]
    assert f"patch {series(repo_copy)[0]}: {ADD_CONSTANT[0]} | Upstream-Status: not for upstream (test fixture)." in lines
    assert f"patch {series(repo_copy)[1]}: {MARK_LINE[0]} | Upstream-Status: not for upstream (test fixture)." in lines
    hooks = [l for l in lines if l.startswith("hook ")]
    assert hooks and all(" -> sglang." in l and "| Upstream-Status:" in l for l in hooks)
    assert lines[-1] == f"queue .upstream/ on upstream/{OLD}: in sync with patches/"


def test_check_rejects_an_import_cycle_and_undeclared_or_missing_swaps(repo_copy):
    root = repo_copy
    ledger = root / "python/sglang/srt/disaggregation/fork_ending/room_ledger.py"
    line = len(ledger.read_text().splitlines()) + 4
    ledger.write_text(ledger.read_text() + "\n\ndef _late():\n    from sglang.srt.managers.fork_pause import pd_pause  # noqa\n")
    plugin = root / "python/sglang/srt/managers/fork_core/fork_plugin.py"
    plugin.write_text(plugin.read_text().replace("MooncakeKVManager.failed_sessions", "MooncakeKVManager.failed_sessionz"))
    chunk = root / "python/sglang/srt/disaggregation/fork_transfer/chunk_failures.py"
    n = len(chunk.read_text().splitlines()) + 4
    chunk.write_text(chunk.read_text() + "\n\ndef _undeclared(mgr):\n"
                     "    fork_touch.swap(mgr, 'session_lock', lambda lock: lock, by=__name__)\n")

    out = fork(root, "check", ok=False).stdout
    assert "FAIL no import cycles: " in out
    assert f"sglang.srt.disaggregation.fork_ending.room_ledger (line {line}) -> sglang.srt.managers.fork_pause.pd_pause (line " in out
    assert ("swap target sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.failed_sessionz "
            f"does not exist in upstream {OLD}") in out
    assert f"sglang.srt.disaggregation.fork_transfer.chunk_failures:{n} swaps 'session_lock' (instance) not declared in SWAPS" in out
    assert "FAIL plugin hooks:" in out and "check: FAILED (" in out and "no import cycles)" in out


def tool_module():
    """tools/fork as a module (its functions, without a subprocess)."""
    loader = SourceFileLoader("fork_tool", str(TOOL))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("fork_tool", loader))
    loader.exec_module(module)
    return module


def test_layers_reject_an_import_against_the_order():
    tool = tool_module()
    graph = tool.import_graph(ROOT)
    assert tool.layer_violations(graph) == []  # the repository as it is
    srt = "sglang.srt."
    ledger, pause = srt + "disaggregation.fork_ending.room_ledger", srt + "managers.fork_pause.pd_pause"
    epoch, touch = srt + "managers.fork_cache.weight_epoch", srt + "managers.fork_core.fork_touch"
    report, stray = srt + "managers.fork_report.pd_resource_report", srt + "managers.fork_stray.thing"
    bad = {m: dict(edges) for m, edges in graph.items()}
    bad[ledger][pause] = 7  # up: ending -> concerns
    bad[epoch][pause] = 8  # sideways: two concerns of one layer
    bad[touch][report] = 9  # the bottom reads the top
    bad[stray] = {touch: 1}  # a module no layer names, tied to the others by an import
    bad[srt + "managers.lone"] = {}  # one no import ties to the others: no layer question
    found = tool.layer_violations(bad)
    assert sorted(found) == sorted([
        f"{stray} is in no layer of tools/fork LAYERS",
        f"{ledger} (line 7, layer ending) imports {pause}, a higher layer's managers.fork_pause (layer concerns)",
        f"{epoch} (line 8, layer concerns) imports {pause}, its own layer's managers.fork_pause (layer concerns)",
        f"{touch} (line 9, layer core) imports {report}, a higher layer's managers.fork_report (layer report)"]), found
    # `from package import module` is named once, by the module
    pkg = srt + "managers.fork_pause"
    assert tool.layer_violations({ledger: {pkg: 3, pause: 3}, pkg: {}, pause: {}}) == [
        f"{ledger} (line 3, layer ending) imports {pause}, a higher layer's managers.fork_pause (layer concerns)"]
    # within one package (and downward) is allowed
    assert tool.layer_violations({ledger: {srt + "disaggregation.fork_ending.pd_queues": 1, touch: 2}}) == []


def test_hooks_on_one_target_sit_together_in_wrap_order():
    tool = tool_module()
    hooks, _ = tool.plugin_tables(ROOT)
    assert tool.hooks_apart(hooks) == []
    apart = [("a.f", "m:x", "AFTER"), ("a.g", "m:y", "AFTER"), ("a.f", "m:z", "BEFORE")]
    assert tool.hooks_apart(apart) == ["hooks on a.f are apart (HOOKS entries 0, 2): list them together, in wrap order"]
    # the order that matters (the last is outermost), as HookRegistry wraps them
    order = {}
    for target, ref, _ in hooks:
        order.setdefault(target.removeprefix("sglang.srt."), []).append(ref.rpartition(".")[2])
    assert order["managers.scheduler.Scheduler.send_abort_output"] == [
        "pd_pause:pause_answer_kept", "room_scheduler_hooks:after_send_abort_output", "request_end_cause:before_send_abort_output"]
    assert order["managers.scheduler.Scheduler.abort_request"] == [
        "scheduler_pause:abort_while_paused", "room_scheduler_hooks:before_abort_request"]
    assert order["disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"] == [
        "room_kv_hooks:on_manager_init", "chunk_failures:guard_transfer_worker", "chunk_failures:on_prefill_manager_init",
        "prefill_side_monitor:on_prefill_manager_init", "paced_write:on_prefill_manager_init",
        "fork_touch:check_at_start"]
    assert order["disaggregation.decode.DecodePreallocQueue._init_kv_manager"] == [
        "room_kv_hooks:on_manager_init", "decode_side_monitor:on_decode_manager_init", "fork_touch:check_at_start"]
    assert order["disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped"] == [
        "transfer_deadline:before_pop_bootstrapped", "lost_handshake:before_pop_bootstrapped",
        "poison_expiry:expire_poison"]
    assert order["disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info"] == [
        "decode_side_monitor:after_try_ensure_parallel_info", "transfer_deadline:around_try_ensure_parallel_info"]
    assert order["disaggregation.common.conn.CommonKVSender.clear"] == [
        "room_kv_hooks:on_sender_clear", "chunk_failures:on_sender_clear", "prefill_side_monitor:on_sender_clear"]
    assert order["disaggregation.common.conn.CommonKVManager.apply_prefill_status"] == [
        "room_kv_hooks:around_apply_prefill_status", "idle_pacing:after_apply_prefill_status"]
    assert order["disaggregation.common.conn.CommonKVManager.update_status"] == [
        "room_kv_hooks:around_update_status", "idle_pacing:after_update_status"]
    assert order["managers.scheduler.Scheduler.process_input_requests"] == [
        "weight_epoch:after_process_input_requests", "pd_metrics:after_process_input_requests"]
    assert order["managers.tokenizer_manager.TokenizerManager.generate_request"] == [
        "resend_wait:tm_generate_request", "bootstrap_door:before_generate_request"]
    # the pause gate's answers first (inner), then a request between recovery attempts (outer)
    assert order["managers.tokenizer_manager.TokenizerManager.abort_request"] == [
        "pause_gate:tm_abort_request", "recovery:after_abort_request"]
    assert order["managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state"] == [
        "tokenizer_pause:tm_internal_state", "recovery:after_internal_state"]
    assert {t for t, refs in order.items() if len(refs) > 1} == {
        "managers.scheduler.Scheduler.send_abort_output", "managers.scheduler.Scheduler.abort_request",
        "managers.scheduler.Scheduler.process_input_requests",
        "managers.tokenizer_manager.TokenizerManager.generate_request",
        "managers.tokenizer_manager.TokenizerManager.abort_request",
        "managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state",
        "disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        "disaggregation.decode.DecodePreallocQueue._init_kv_manager",
        "disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
        "disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info",
        "disaggregation.common.conn.CommonKVSender.clear",
        "disaggregation.common.conn.CommonKVManager.apply_prefill_status",
        "disaggregation.common.conn.CommonKVManager.update_status"}


def test_check_rejects_an_import_against_the_layers_and_hooks_apart(repo_copy):
    root = repo_copy
    cause = root / "python/sglang/srt/disaggregation/fork_ending/request_end_cause.py"
    line = len(cause.read_text().splitlines()) + 4
    cause.write_text(cause.read_text() + "\n\ndef _late():\n"
                     "    from sglang.srt.disaggregation.fork_transfer import transfer_deadline_knob  # noqa\n")
    plugin = root / "python/sglang/srt/managers/fork_core/fork_plugin.py"
    text = plugin.read_text()
    moved = '    ("managers.scheduler.Scheduler.send_abort_output", "pd_pause:pause_answer_kept", BEFORE),\n'
    assert text.count(moved) == 1
    text = text.replace(moved, "").replace("\n]]\n", "\n" + moved + "]]\n", 1)
    plugin.write_text(text)
    report = root / "python/sglang/srt/managers/fork_report/pd_resource_report.py"
    report.write_text(report.read_text().replace('"sglang.srt.disaggregation.decode.DecodeReqToTokenPool"',
                                                 '"sglang.srt.disaggregation.decode.DecodeReqToTokenPul"'))

    out = fork(root, "check", ok=False).stdout
    assert ("FAIL import layers: sglang.srt.disaggregation.fork_ending.request_end_cause "
            f"(line {line}, layer ending) imports sglang.srt.disaggregation.fork_transfer.transfer_deadline_knob, "
            "a higher layer's disaggregation.fork_transfer (layer concerns); imports run down the layers core (") in out
    assert "ok   no import cycles:" in out  # not a circle: the layer order alone rejects it
    assert re.search(r"(?m)^FAIL plugin hooks: (.*; )?hooks on sglang\.srt\.managers\.scheduler\.Scheduler\."
                     r"send_abort_output are apart \(HOOKS entries \d+, \d+, \d+\): list them together", out), out
    assert ("sglang.srt.managers.fork_report.pd_resource_report:27 DECODE_REQ_POOL names "
            f"sglang.srt.disaggregation.decode.DecodeReqToTokenPul, which does not exist in upstream {OLD}") in out
    assert "check: FAILED (plugin hooks, import layers)" in out
