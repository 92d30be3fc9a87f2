"""The soak, 10 seconds of it, against a real tritonserver: every request ends as expected, every stream has its
FINAL, no KV block leaks, and sampled greedy outputs equal LLM.generate. No engine kills here (`make soak` kills
it, and tests/test_supervision.py kills it under each front end)."""
from __future__ import annotations

from scripts import soak


def test_ten_second_soak(tiny_dir, tmp_path):
    summary = soak.main(["--seconds", "10", "--concurrency", "8", "--model", tiny_dir, "--check", "6",
                         "--log", str(tmp_path / "server.log")])
    assert summary["unexpected errors"] == 0, summary["first errors"]
    assert summary["responses without FINAL"] == 0 and summary["leaked blocks"] == 0
    assert summary["greedy mismatches"] == 0 and summary["greedy outputs checked"] >= 1
    assert summary["completed"] > 20 and summary["cancelled"] > 0 and summary["rejected as expected"] > 0
    assert summary["prompt-cache hits"] > 0
    assert summary["engine kills"] == 0 and summary["restarts"] == 0
    assert summary["ok"]
