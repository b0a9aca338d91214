"""The user docs (README.md, CHANGELOG.md, docs/*.md) against their sources: a figure, default, cap or count in
them that disagrees with the code, the tree or bench/README.md's latest bench blocks fails here.

Sources: the generated blocks (`testing/doc_tables.py`: the knob and status tables of docs/operations.md from
`knobs.py`, upstream's `Envs`, sglang-router's `RouterArgs` and `verdict_rows.TABLE`; README's bench summary from
bench/README.md), the patch series and `fork_plugin.HOOKS`/`SWAPS` (counts), `room_ledger.MAX_RECORDS` and the
other caps, every knob's default wherever a doc quotes one, the fork/upstream KV rate wherever a doc quotes it.
Fast; starts no server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from sglang.srt.disaggregation.fork_ending import request_end_cause, room_ledger, teller, verdict_rows
from sglang.srt.disaggregation.fork_transfer import transfer_deadline
from sglang.srt.environ import envs
from sglang.srt.managers.fork_core import knobs
from sglang.srt.managers.fork_pause import pd_pause
from testing import doc_tables

pytestmark = pytest.mark.unit

ROOT = doc_tables.ROOT
USER_DOCS = [doc_tables.README, doc_tables.CHANGELOG, *sorted((ROOT / "docs").glob("*.md"))]


def docs_text() -> Dict[Path, str]:
    return {path: path.read_text() for path in USER_DOCS}


def where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}"


def findall(pattern: str) -> List[Tuple[str, "re.Match[str]"]]:
    return [(where(path, text, m.start()), m) for path, text in docs_text().items()
            for m in re.finditer(pattern, text)]


# ----------------------------------------------------------------------------- generated blocks


@pytest.mark.parametrize("path,name", [(p, n) for p, blocks in doc_tables.GENERATED.items() for n in blocks],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_each_generated_block_equals_what_its_source_makes(path, name):
    body = doc_tables.GENERATED[path][name]()
    assert doc_tables.block(path.read_text(), name) == body, (
        f"{path.relative_to(ROOT)}: the {name!r} block differs from its source: "
        "run `python -m testing.doc_tables --write`")


def test_every_knob_and_every_verdict_row_is_described():
    assert set(doc_tables.FORK_KNOBS) == {k.name for k in knobs.KNOBS}, "a knob without a line in doc_tables"
    assert set(doc_tables.ADVICE) == {c.name for c in verdict_rows.Cause}, "a verdict cause without advice"
    ops = doc_tables.OPERATIONS.read_text()
    for knob in knobs.KNOBS:
        assert f"`{knob.name}`" in ops
    for row in verdict_rows.TABLE:
        assert f"| {row.cause.value} | {verdict_rows.cells(row)[0]} |" in ops


# ----------------------------------------------------------------------------- counts and caps


@pytest.mark.parametrize("what", ["patches", "hooks", "swaps"])
def test_counts_quoted_in_the_docs_are_the_trees(what):
    count = doc_tables.counts()[what]
    wrong = [(at, m.group(0)) for at, m in findall(rf"\b(\d+) {what}\b") if int(m.group(1)) != count]
    assert not wrong, f"the tree has {count} {what}; the docs say: {wrong}"


CAPS = {  # a bounded memory's cap, by the words docs use for it
    "ended rooms": room_ledger.MAX_RECORDS,
    "queued tells": teller.MAX_QUEUED,
    "tagged rooms": request_end_cause.MAX_TAGGED_ROOMS,
    "pause reasons": pd_pause.MAX_WHY_ROOMS,
    "ranks a tell looks up": teller.MAX_RANKS,
    "bootstrap fetches": transfer_deadline.MAX_FETCHES,
}


def test_the_ended_rooms_memory_is_quoted_as_the_ledgers_cap():
    pattern = (r"(?:RoomLedger\.ended`?|[Rr]emembers?|keeps?|memory of ended rooms)[^.|]{0,80}?"
               r"(?:at most|the last) (\d[\d,]*)")
    found = findall(pattern)
    assert found, "no doc quotes the ended-rooms cap (the pattern went stale?)"
    wrong = [(at, m.group(0)) for at, m in found if int(m.group(1).replace(",", "")) != CAPS["ended rooms"]]
    assert not wrong, f"RoomLedger keeps at most {CAPS['ended rooms']} ended rooms; the docs say: {wrong}"


def test_every_large_cap_quoted_is_one_of_the_codes():
    wrong = [(at, m.group(0)) for at, m in findall(r"at most (\d[\d,]{3,})")
             if int(m.group(1).replace(",", "")) not in CAPS.values()]
    assert not wrong, f"caps in the code: {CAPS}; the docs quote others: {wrong}"


# ----------------------------------------------------------------------------- defaults


def known_defaults() -> Dict[str, float]:
    defaults = {k.name: k.default for k in knobs.KNOBS}
    for name in re.findall(r"`(SGLANG_[A-Z0-9_]+)`", "\n".join(docs_text().values())):
        field = getattr(envs, name, None)
        if field is not None and isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
            defaults.setdefault(name, float(field.default))
    for setting, _, default, _, _ in doc_tables.EXTERNAL_SETTINGS:
        defaults[setting.strip("`")] = float(default.split()[0])
    return defaults


DEFAULT_QUOTE = re.compile(
    r"`(?P<name>(?:SGLANG|MC)_[A-Z0-9_]+)`(?P<gap>[^`|;\n()]{0,45}?|\s*/\s*`--[a-z-]+`\s*)"
    r"[(,]\s*(?:default\s+)?(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>ms|s)?(?![\w.])")


def test_every_knob_default_quoted_in_the_docs_is_the_codes():
    defaults, wrong, checked = known_defaults(), [], 0
    for at, m in findall(DEFAULT_QUOTE.pattern):
        name = m.group("name")
        if name not in defaults or "SGLANG_" in m.group("gap") or "MC_" in m.group("gap"):
            continue
        value = float(m.group("value")) / (1000 if m.group("unit") == "ms" else 1)
        checked += 1
        if value != defaults[name]:
            wrong.append((at, m.group(0), defaults[name]))
    assert checked >= 5, f"only {checked} quoted defaults found: the pattern went stale?"
    assert not wrong, f"quoted defaults that are not the code's (where, text, default): {wrong}"


PHRASES = [  # figures the README and CHANGELOG state in words, and their source
    (r"\((\d+) s default\)", lambda: knobs.TRANSFER_TIMEOUT.default),
    (r"waits up to (\d+) ms per idle pass", lambda: knobs.PD_IDLE_PACE.default * 1000),
    (r"`SGLANG_FORK_PD_IDLE_PACE` \((\d+) ms\)", lambda: knobs.PD_IDLE_PACE.default * 1000),
    (r"declared lost within (two) heartbeats", lambda: envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.default),
    (r"502 within (two) heartbeats", lambda: envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.default),
]
WORDS = {"one": 1, "two": 2, "three": 3}


@pytest.mark.parametrize("pattern,source", PHRASES, ids=[p for p, _ in PHRASES])
def test_figures_stated_in_words_are_their_sources(pattern, source):
    for at, m in findall(pattern):
        said = WORDS.get(m.group(1)) or float(m.group(1))
        assert said == source(), f"{at}: {m.group(0)!r}, the source says {source()}"


# ----------------------------------------------------------------------------- bench figures


def test_the_fork_upstream_kv_rate_quoted_anywhere_is_the_latest_benchs():
    bench = doc_tables.BENCH_README.read_text()
    rate = doc_tables.rate_range_text(bench)
    found = findall(r"(\d+\.\d+)\s*[-–]\s*(\d+\.\d+)\s*x (?:upstream|the upstream)")
    assert found, "no doc quotes the fork/upstream KV rate (the pattern went stale?)"
    wrong = [(at, m.group(0)) for at, m in found if f"{m.group(1)}-{m.group(2)}x" != rate]
    assert not wrong, f"bench/README.md's latest transfer run: {rate} upstream; the docs say: {wrong}"


# ----------------------------------------------------------------------------- what user docs never say


@pytest.mark.parametrize("pattern,what", [
    (r"(?i)\bsession \d+", "work-session numbers"),
    (r"(?i)\bissues? \d+|#\d{1,4}\b", "tracker issue numbers"),
    (r"(?<![\w.])/(?:work|tmp|root|home)/", "paths of a machine"),
], ids=["session", "issue", "path"])
def test_user_docs_carry_no_history_of_the_work(pattern, what):
    found = [(at, m.group(0)) for at, m in findall(pattern)]
    bench = doc_tables.BENCH_README.read_text()  # the bench history too: runs are named by date and number
    found += [(where(doc_tables.BENCH_README, bench, m.start()), m.group(0)) for m in re.finditer(pattern, bench)]
    assert not found, f"{what} in user docs: {found}"


def test_relative_links_of_the_user_docs_resolve():
    broken = []
    for path, text in docs_text().items():
        for m in re.finditer(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (path.parent / m.group(1)).exists():
                broken.append((where(path, text, m.start()), m.group(1)))
    assert not broken, f"links to nothing: {broken}"


# ----------------------------------------------------------------------------- README and CHANGELOG shape


def test_the_readme_opens_with_make_demo_and_make_test():
    head = doc_tables.README.read_text().split("\n## ", 1)[0]
    assert head.index("make demo") < head.index("make test") < head.index("| upstream 0.5.23 does | the fork does |")


def read_lock() -> Tuple[str, str]:
    text = (ROOT / "upstream.lock").read_text()
    return (re.search(r'(?m)^\s*version\s*=\s*"([^"]+)"', text).group(1),
            re.search(r'(?m)^\s*local\s*=\s*"([^"]+)"', text).group(1))


SECTIONS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security", "Known limits",
            "Upstream"}  # Keep a Changelog's, the known limits, and the section `tools/fork rebase` writes


def test_the_changelog_is_one_entry_per_release_in_keep_a_changelog_sections():
    version, local = read_lock()
    text = doc_tables.CHANGELOG.read_text()
    releases = re.findall(r"(?m)^## (.+)$", text)
    assert releases and releases[0].startswith(f"{version}+{local}"), (releases[:1], version, local)
    assert len(releases) == len(set(releases)), f"a release has two entries: {releases}"
    for release in re.split(r"(?m)^## ", text)[1:]:
        sections = re.findall(r"(?m)^### (.+)$", release)
        assert set(sections) <= SECTIONS, f"{release.splitlines()[0]}: sections {sections}"
        assert len(sections) == len(set(sections)), f"{release.splitlines()[0]}: a section twice: {sections}"


def test_every_metric_the_docs_name_exists():
    import sglang

    names = {m.group(1) for _, m in findall(r"`?(sglang:[a-z_]+)")}
    code = "\n".join(p.read_text(errors="replace") for p in Path(sglang.__file__).parent.joinpath("srt").rglob("*.py"))
    missing = sorted(n for n in names if n.split(":", 1)[1] not in code)
    assert names and not missing, f"metrics the docs name that no code defines: {missing}"
