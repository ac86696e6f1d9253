"""The README and docs/ state what the result files say, the README names the
commands CI runs, and every docs page is reachable from the README."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_performance_table_is_generated_from_the_result_files():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/train.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _anchors(page: pathlib.Path) -> set:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_docs_links_resolve_and_every_page_is_linked_from_the_readme():
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in pages[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
