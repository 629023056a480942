"""The CPU kernels' build: one translation unit, experts.c, whose cached library's name covers every file it
includes, so that an edit to any of them builds anew."""

from __future__ import annotations

import re
import shutil

from asyncmoe.compute.cpu import build


def test_sources_are_the_files_the_build_includes():
    included = {build.SOURCE.name}
    for path in build.sources():
        included |= set(re.findall(r'#include "([^"]+)"', path.read_text()))
    assert included == {path.name for path in build.sources()}


def test_cache_key_covers_every_source(tmp_path, monkeypatch):
    for path in build.sources():
        shutil.copy(path, tmp_path)
    monkeypatch.setattr(build, "SOURCE", tmp_path / build.SOURCE.name)
    compiler = build.find_compiler()
    keys = {build._key(compiler, build.FLAGS)}
    for path in sorted(tmp_path.iterdir()):
        path.write_text(path.read_text() + "\n")
        keys.add(build._key(compiler, build.FLAGS))
    assert len(keys) == len(build.sources()) + 1
