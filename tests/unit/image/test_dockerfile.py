"""sparkctl.image.dockerfile: the parent build argument and the context files of a Dockerfile it did not write."""

from __future__ import annotations

from sparkctl.image import dockerfile as D


def test_the_parent_argument_is_declared_before_from_and_used_by_the_final_stage() -> None:
    assert D.parse("ARG BASE\nFROM ${BASE}\n").base_arg == "BASE"
    assert D.parse("ARG PARENT=x/y:z\nFROM $PARENT AS final\n").base_arg == "PARENT"
    # the final stage rests on an earlier one that took the argument
    assert D.parse("ARG BASE\nFROM ${BASE} AS build\nRUN make\nFROM build\n").base_arg == "BASE"
    # an ARG after FROM is a build-stage argument, not one FROM can use
    info = D.parse("FROM ghcr.io/a/b:exl3\nARG BASE\n")
    assert info.base_arg is None and info.first_from == "ghcr.io/a/b:exl3"
    assert D.parse("FROM debian:bookworm AS a\nARG BASE\nFROM ${BASE}\n").base_arg is None  # Docker would not expand it
    # a final stage from a fixed image does not rest on the parent, even if an earlier one did
    assert D.parse("ARG BASE\nFROM ${BASE} AS a\nFROM debian:bookworm\n").base_arg is None


def test_copy_sources_skip_other_stages_urls_and_flags() -> None:
    text = ("ARG BASE\nFROM ${BASE}\n# a comment\nCOPY --chown=0:0 a.py \\\n  # inside\n  b/ /opt/\n"
            "ADD https://example.invalid/x.tar /tmp/\nCOPY --from=build /x /y\nCOPY [\"c d.py\", \"/z/\"]\n")
    assert D.parse(text).sources == ("a.py", "b/", "c d.py")


def test_sources_match_files_folders_and_globs() -> None:
    files = ["a.py", "b/x.py", "b/y/z.sh", "patch_1.py", "patch_2.py", "Dockerfile.dcp"]
    assert D.match_sources(["a.py", "b/", "patch_*.py"], files) == (
        ["a.py", "b/x.py", "b/y/z.sh", "patch_1.py", "patch_2.py"], [])
    assert D.match_sources(["./a.py", "missing.py"], files) == (["a.py"], ["missing.py"])
    assert D.match_sources(["."], files)[0] == sorted(files)
