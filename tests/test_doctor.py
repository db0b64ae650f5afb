"""`specd doctor` against real services on loopback, with tiny pairs whose answers are
known: a draft with another tokenizer, an unrelated draft (distill it, exit code 2), a
close draft (exact, aligned), and a costly draft that never agrees (its best γ is 1)."""
from __future__ import annotations

import json

import grpc
import pytest
from transformers import AutoTokenizer

from conftest import make_model, request, start_stack
from gateway.stats.drift import load_baseline
from specd.contract import DIAGNOSTIC_SEGMENT
from specd.v1 import gateway_pb2
from specd_cli import main
from specd_cli.doctor import Prober, best_gamma, check_tokenizers, diagnose, sweep_gamma

PROMPTS = ["def fibonacci(n):", "The acceptance rate is"]


@pytest.fixture(scope="module")
def clinic(model_dirs, tmp_path_factory):
    """Drafts: close, unrelated, costly (12 × 256, random: it never agrees) and alien (another tokenizer)."""
    costly = tmp_path_factory.mktemp("costly") / "costly"
    make_model(costly, AutoTokenizer.from_pretrained(model_dirs["target"]), seed=7, layers=12, hidden=256)
    running = start_stack({**model_dirs, "costly": costly}, drafts=("close", "unrelated", "costly", "alien"))
    yield running
    running.close()


def lifetime_totals(stub) -> tuple:
    (row,) = stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest()).rows
    return row.drafts, row.draft_tokens, row.accepted_tokens


def test_a_draft_with_another_tokenizer_is_set_aside_and_reported(clinic):
    info = clinic.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
    drafts = {d.name: d for d in info.drafts}
    assert [name for name, d in drafts.items() if not d.usable] == ["alien"]
    assert "does not share the target 'target''s tokenizer" in drafts["alien"].problem
    (finding,) = [f for f in check_tokenizers(info) if f.severity != "ok"]
    assert finding.check == "tokenizer" and finding.figures["draft"] == "alien"
    assert drafts["alien"].tokenizer_fingerprint[:12] in finding.evidence
    assert info.target.tokenizer_fingerprint[:12] in finding.evidence
    # And it is never used: a request naming it is refused with the reason.
    with pytest.raises(grpc.RpcError) as err:
        clinic.stub.Generate(request("x", draft_model="alien"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokenizer" in err.value.details() and "close" in err.value.details()


def test_unrelated_draft_gets_the_distill_command_and_exit_code_2(clinic, model_dirs, tmp_path, capsys):
    clinic.stub.Generate(request("warm the lifetime counters up", max_new_tokens=8))
    before = lifetime_totals(clinic.stub)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    baseline = tmp_path / "baseline.json"
    code = main(["doctor", "--gateway", clinic.gateway_address, "--draft-model", "unrelated", "--task", "code",
                 "--prompts", str(prompts), "--max-new-tokens", "12", "--max-gamma", "2", "--sweep-prompts", "1",
                 "--json", "--write-baseline", str(baseline)])
    report = json.loads(capsys.readouterr().out)
    assert code == 2 and report["exit_code"] == 2
    findings = {f["check"]: f for f in report["findings"] if f["check"] != "tokenizer"}
    target, unrelated = model_dirs["target"].resolve(), model_dirs["unrelated"].resolve()
    assert findings["acceptance"]["severity"] == "hurting"
    assert findings["acceptance"]["fix"] == (f"specd distill --target {target} --draft {unrelated} "
                                             f"--data {prompts} --out {unrelated}-distilled")
    assert findings["quality"]["severity"] == "hurting"
    assert findings["exactness"]["severity"] == "ok"  # hurting, yet exact
    assert load_baseline(baseline) == {("unrelated->target", "code"): pytest.approx(report["alpha"],
                                                                                  abs=1e-4)}
    # The doctor's requests left production statistics alone.
    assert lifetime_totals(clinic.stub) == before
    segments = clinic.stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest(group_by=["user_segment"])).rows
    assert DIAGNOSTIC_SEGMENT not in {row.labels["user_segment"] for row in segments}


def test_a_close_draft_is_exact_and_its_sampling_aligned(clinic):
    diagnosis = diagnose(clinic.stub, [("code", p) for p in PROMPTS], temperature=0.7, max_new_tokens=12,
                         draft_model="close", sweep_prompts=1, max_gamma=2)
    findings = {f.check: f for f in diagnosis.findings if f.check != "tokenizer"}
    assert findings["exactness"].severity == "ok"
    assert findings["sampling alignment"].severity == "ok"
    assert findings["sampling alignment"].figures["top1_equals_greedy"] == len(PROMPTS)
    # 0.7 → 0.5, 0.3, 0.1, 0: the trade-off table has a row per temperature.
    assert [row["temperature"] for row in findings["temperature"].figures["table"]] == [0.7, 0.5, 0.3, 0.1, 0.0]
    assert set(findings) >= {"acceptance", "draft length", "position", "short outputs", "memory"}


def test_gamma_sweep_finds_gamma_1_for_a_costly_draft_that_never_agrees(clinic):
    # By construction: a draft that (almost) never agrees emits one token per step whatever
    # γ is, and each extra draft token costs a 12-layer forward; the best γ is the least.
    prober = Prober(clinic.stub, [("code", p) for p in PROMPTS], 16, "costly")
    sweep = sweep_gamma(prober, range(1, 5), temperature=0.0)
    assert all(run.result.acceptance_rate < 0.05 for run in sweep), [run.result.acceptance_rate for run in sweep]
    assert best_gamma(sweep) == 1, [(run.result.config.draft_length, run.result.tokens_per_s) for run in sweep]
