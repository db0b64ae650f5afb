"""The committed generated code matches the .proto sources (regenerate: scripts/gen_proto.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen_proto = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_proto)
    gen_proto.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh, "protoc produced nothing"
    for relative in fresh:
        committed = ROOT / relative
        assert committed.is_file(), f"{relative} is not committed; run python scripts/gen_proto.py"
        assert committed.read_text() == (tmp_path / relative).read_text(), \
            f"{relative} is stale; run python scripts/gen_proto.py and commit the result"
