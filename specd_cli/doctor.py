"""`specd doctor`: a checklist of what lowers acceptance, run against a live gateway.

Over gRPC only (GetGatewayInfo and Generate), so it works on a remote cluster. Every
request it sends carries the diagnostic user segment ("specd-doctor"): the gateway
serves it like any other but leaves it out of its acceptance statistics, cost tables,
drift detection and draft selection, so a diagnosis never skews production figures.

Checks (one finding each, or one per draft): tokenizer fingerprints of every hosted
draft; sampling alignment (a top-k=1 probe must reproduce greedy decoding exactly);
exactness of greedy output against target-only; acceptance against the draft's model
card, with the `specd distill` command when α < 0.6; a γ sweep (tokens/s and tokens per
step for γ = 1..min(20, the gateway's maximum)) against the configured policy's choice;
quality mismatch (α > 0.95 or α < 0.4); a temperature trade-off table; acceptance early
vs late in the generation; short outputs; the draft's bytes next to the target's.

Exit code: 0 healthy, 1 warnings, 2 speculation is hurting (or broken).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gateway.stats.acceptance import Counts
from specd.contract import DIAGNOSTIC_SEGMENT, baseline_document, model_pair_label
from specd.steps import card_acceptance
from specd.tls import add_client_arguments, client_channel, client_tls_from_args
from specd_cli.bench import DEMO_WORKLOAD, Config, Result, add_stats, build_request
from specd_cli.clientauth import add_api_key_argument, with_api_key

SEVERITY_EXIT = {"ok": 0, "info": 0, "warn": 1, "hurting": 2}
DISTILL_BELOW = 0.6  # α below which a draft should be distilled on the target's outputs
TOO_GOOD = 0.95  # α above which the draft may be doing the target's job
TOO_POOR = 0.4  # α below which speculation slows decoding down
SHORT_OUTPUT = 50  # median generated tokens below which speculation rarely pays
MAX_SWEEP = 20  # the longest γ the sweep tries (capped by the gateway's maximum)


@dataclass
class Finding:
    """One line of the diagnosis: what was checked, the evidence, the fix."""

    check: str
    severity: str  # ok | info | warn | hurting
    evidence: str
    fix: str = ""
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        fix = f" → {self.fix}" if self.fix else ""
        return f"[{self.severity.upper():7}] {self.check}: {self.evidence}{fix}"


@dataclass
class Run:
    """One configuration over the prompts: the summed result and every response's stats."""

    result: Result
    stats: list = field(default_factory=list)  # GenerationStats per request
    outputs: list[list[int]] = field(default_factory=list)


class Prober:
    """Sends the doctor's requests (diagnostic segment, fixed seeds) and sums what comes back."""

    def __init__(self, stub, workload: list[tuple[str, str]], max_new_tokens: int, draft_model: str,
                 timeout_s: float = 600.0) -> None:
        self.stub = stub
        self.workload = workload  # (task type, prompt)
        self.max_new_tokens = max_new_tokens
        self.draft_model = draft_model
        self.timeout_s = timeout_s

    def run(self, config: Config, *, temperature: float = 0.0, top_k: int = 0, limit: int = 0) -> Run:
        """Every prompt (or the first `limit`) once under `config`; seeds 1, 2, ... per prompt."""
        (run,) = self.compare([config], temperature=temperature, top_k=top_k, limit=limit)
        return run

    def compare(self, configs: list[Config], *, temperature: float = 0.0, top_k: int = 0, limit: int = 0,
                warm_up: bool = False) -> list[Run]:
        """Every configuration on each prompt in turn, so a shared machine's slow moments hit
        them all alike (timings are compared); warm_up: one discarded request each first."""
        runs = [Run(Result(config)) for config in configs]
        prompts = self.workload[:limit or None]
        if warm_up:
            for config in configs:
                self._generate(prompts[0], config, temperature, top_k, seed=1)
        for seed, (task, prompt) in enumerate(prompts, start=1):
            for run in runs:
                began = time.perf_counter()
                response = self._generate((task, prompt), run.result.config, temperature, top_k, seed)
                add_stats(run.result, response.stats.task_type, response.stats, time.perf_counter() - began)
                run.stats.append(response.stats)
                run.outputs.append(list(response.token_ids))
        return runs

    def _generate(self, item: tuple[str, str], config: Config, temperature: float, top_k: int, seed: int):
        task, prompt = item
        request = build_request(prompt, task, config, temperature=temperature, top_k=top_k,
                                max_new_tokens=self.max_new_tokens, seed=seed, draft_model=self.draft_model,
                                user_segment=DIAGNOSTIC_SEGMENT)
        return self.stub.Generate(request, timeout=self.timeout_s)


# -- the checks: pure functions of what was measured ----------------------------------------

def _counts(run: Run) -> Counts:
    return Counts(proposed_per_position=list(run.result.proposed_per_position),
                  accepted_per_position=list(run.result.accepted_per_position))


def alpha(run: Run) -> float:
    """α as the geometric model and the model cards mean it: P(a draft token is accepted |
    the ones before it were), pooled over draft positions. (accepted / proposed is lower:
    it also counts the proposals after a rejection, which never had a chance.)"""
    return _counts(run).alpha


def reached(run: Run) -> int:
    """Draft positions reached with every earlier one accepted: what α was measured over."""
    return _counts(run).reached_tokens


def check_tokenizers(info) -> list[Finding]:
    """Every hosted draft's tokenizer fingerprint against the target's."""
    target = info.target
    findings = []
    for draft in info.drafts:
        if draft.model_free:  # drafts from the target's own tokens: nothing to compare
            continue
        figures = {"draft": draft.name, "draft_fingerprint": draft.tokenizer_fingerprint,
                   "target_fingerprint": target.tokenizer_fingerprint, "usable": draft.usable}
        if draft.tokenizer_fingerprint == target.tokenizer_fingerprint:
            findings.append(Finding("tokenizer", "ok", f"draft {draft.name!r} shares the target's tokenizer "
                                    f"({target.tokenizer_fingerprint[:12]}, vocab {target.vocab_size})",
                                    figures=figures))
        else:
            findings.append(Finding(
                "tokenizer", "warn",
                f"draft {draft.name!r} has tokenizer {draft.tokenizer_fingerprint[:12]} (vocab {draft.vocab_size}) "
                f"but the target {target.name!r} has {target.tokenizer_fingerprint[:12]} (vocab {target.vocab_size}): "
                f"the gateway never uses it",
                f"drop `--draft {draft.name}=...` from the draft service, or train a draft on the target's "
                f"tokenizer ({target.model_path or target.name})", figures))
    return findings


def check_sampling(greedy: Run, top1: Run, target_only: Run) -> list[Finding]:
    """Greedy output must equal target-only's; a top-k=1 sample must equal greedy, acceptance too.

    With top_k=1 both p and q are one-hot, so rejection sampling reduces to greedy:
    identical tokens and identical accepted lengths, unless the draft's or the target's
    transforms (temperature, top-k, top-p) are applied differently.
    """
    n = len(greedy.outputs)
    exact = sum(a == b for a, b in zip(greedy.outputs, target_only.outputs))
    aligned = sum(a == b for a, b in zip(greedy.outputs, top1.outputs))
    same_acceptance = sum(list(a.accepted_lengths) == list(b.accepted_lengths)
                          for a, b in zip(greedy.stats, top1.stats))
    figures = {"prompts": n, "greedy_equals_target_only": exact, "top1_equals_greedy": aligned,
               "top1_same_acceptance": same_acceptance, "greedy_acceptance": greedy.result.acceptance_rate,
               "top1_acceptance": top1.result.acceptance_rate}
    findings = []
    if exact == n:
        findings.append(Finding("exactness", "ok", f"greedy speculative output equals target-only on {n}/{n} prompts",
                                figures=figures))
    else:
        findings.append(Finding("exactness", "hurting",
                                f"greedy speculative output differs from target-only on {n - exact}/{n} prompts",
                                "report a bug with these prompts; serve with SPECULATION_MODE_OFF meanwhile", figures))
    if aligned == n and same_acceptance == n:
        findings.append(Finding(
            "sampling alignment", "ok",
            f"temperature 1, top-k 1 reproduces greedy on {n}/{n} prompts with the same accepted/proposed "
            f"({top1.result.acceptance_rate:.3f} vs {greedy.result.acceptance_rate:.3f}): draft and target apply "
            f"the same transforms", figures=figures))
    else:
        findings.append(Finding(
            "sampling alignment", "hurting",
            f"temperature 1, top-k 1 should reproduce greedy exactly but matched {aligned}/{n} outputs and "
            f"{same_acceptance}/{n} acceptance traces (acceptance rate {top1.result.acceptance_rate:.3f} vs greedy "
            f"{greedy.result.acceptance_rate:.3f}): draft and target do not apply the same temperature/top-k/top-p",
            "run the draft and verifier services from the same specd version (both apply "
            "specd.sampling.Transform); check for a patched worker", figures))
    return findings


def card_expectation(card_json: str, tasks: list[str], temperature: float) -> tuple[float, int] | None:
    """The α a draft's model card promises for these task types, and the γ it was measured at
    (greedy: the card's greedy match rate; sampled: its α)."""
    table = card_acceptance(card_json)
    key = "greedy_match" if temperature == 0 else "alpha"
    # The cards name prose "prose"; the gateway's task for prose is "general".
    aliases = {"general": "prose", "qa": "prose", "summarization": "prose"}
    found = [table.get(t) or table.get(aliases.get(t, "")) for t in tasks]
    rows = [r for r in found if r and key in r] or [r for r in table.values() if key in r]
    if not rows:
        return None
    return statistics.fmean(r[key] for r in rows), int(rows[0].get("gamma", 4))


def distill_command(target_path: str, draft_path: str, prompts_file: str) -> str:
    """The `specd distill` command line that trains this pair's draft on the target's outputs
    (TARGET_DIR and DRAFT_DIR where the gateway does not show paths: it requires API keys)."""
    target_path, draft_path = target_path or "TARGET_DIR", draft_path or "DRAFT_DIR"
    return (f"specd distill --target {target_path} --draft {draft_path} --data {prompts_file} "
            f"--out {draft_path.rstrip('/')}-distilled")


def check_acceptance(measured: Run, card: tuple[float, int] | None, draft, target, prompts_file: str,
                     temperature: float) -> Finding:
    """Measured α and tokens/step at the card's γ against the card; distill below 0.6."""
    a = alpha(measured)
    figures = {"alpha": a, "acceptance_rate": measured.result.acceptance_rate,
               "tokens_per_step": measured.result.tokens_per_step,
               "gamma": measured.result.config.draft_length, "card_alpha": card[0] if card else None}
    against = f", card α {card[0]:.3f}" if card else ", no model card"
    evidence = (f"draft {draft.name!r}: α {a:.3f} (accepted/proposed {measured.result.acceptance_rate:.3f}), "
                f"{measured.result.tokens_per_step:.2f} tokens/step at γ={measured.result.config.draft_length}, "
                f"temperature {temperature}{against}")
    if a < DISTILL_BELOW:
        return Finding("acceptance", "hurting" if a < TOO_POOR else "warn",
                       evidence + f"; below {DISTILL_BELOW}: the draft does not imitate this target",
                       distill_command(target.model_path, draft.model_path, prompts_file), figures)
    if card and a < card[0] - 0.1:
        return Finding("acceptance", "warn", evidence + "; more than 10 points under the card: this workload "
                       "differs from the card's evaluation data", "distill on this workload: "
                       + distill_command(target.model_path, draft.model_path, prompts_file), figures)
    return Finding("acceptance", "ok", evidence, figures=figures)


def sweep_gamma(prober: Prober, gammas: range, temperature: float, limit: int = 0) -> list[Run]:
    """FIXED γ for each γ in `gammas` over the first `limit` prompts (0: all), interleaved,
    after a warm-up request each (the first requests pay one-off costs)."""
    return prober.compare([Config(f"fixed γ={g}", "fixed", "fixed", g) for g in gammas],
                          temperature=temperature, limit=limit, warm_up=True)


def best_gamma(sweep: list[Run]) -> int:
    """The swept γ with the most tokens/s (wall time of whole requests, as a client sees it)."""
    return max(sweep, key=lambda run: run.result.tokens_per_s).result.config.draft_length


def check_gamma(sweep: list[Run], auto: Run, configured_policy: str, max_gamma: int) -> Finding:
    """The γ with the best tokens/s, and how far the configured policy's choice is from it."""
    rows = [{"gamma": r.result.config.draft_length, "tokens_per_s": r.result.tokens_per_s,
             "tokens_per_step": r.result.tokens_per_step, "acceptance_rate": r.result.acceptance_rate} for r in sweep]
    best = next(row for row in rows if row["gamma"] == best_gamma(sweep))
    drafted = [g for s in auto.stats for g in s.draft_lengths]
    mean_gamma = statistics.fmean(drafted) if drafted else 0.0
    gap = 1 - auto.result.tokens_per_s / best["tokens_per_s"] if best["tokens_per_s"] else 0.0
    figures = {"sweep": rows, "best_gamma": best["gamma"], "policy": configured_policy,
               "policy_mean_gamma": mean_gamma, "policy_tokens_per_s": auto.result.tokens_per_s, "gap": gap}
    table = " ".join(f"γ{row['gamma']}:{row['tokens_per_s']:.0f}t/s,{row['tokens_per_step']:.2f}t/step"
                     for row in rows)
    evidence = (f"best γ={best['gamma']} ({best['tokens_per_s']:.1f} tokens/s, {best['tokens_per_step']:.2f} "
                f"tokens/step) of 1..{max_gamma}; policy {configured_policy!r} used mean γ {mean_gamma:.1f} at "
                f"{auto.result.tokens_per_s:.1f} tokens/s ({_gap_words(gap)}) [{table}]")
    if gap > 0.15:
        return Finding("draft length", "warn", evidence,
                       f"pin it: SpeculationParams{{mode: FIXED, draft_length: {best['gamma']}}} for this task, "
                       f"or start the gateway with --policy fixed --draft-length {best['gamma']}", figures)
    return Finding("draft length", "ok", evidence, figures=figures)


def _gap_words(gap: float) -> str:
    return f"{gap:.0%} below the best" if gap > 0 else f"{-gap:.0%} above the best fixed γ: within noise or better"


def check_quality(auto: Run, target_only: Run, draft, policy: str) -> Finding | None:
    """α > 0.95: the draft may do the target's job; α < 0.4: speculation costs more than it saves."""
    a = alpha(auto)
    speedup = auto.result.tokens_per_s / target_only.result.tokens_per_s if target_only.result.tokens_per_s else 0
    figures = {"alpha": a, "speedup": speedup}
    if a > TOO_GOOD:
        whole = sum(s.accepted_tokens == s.proposed_tokens for s in auto.stats)
        return Finding("quality", "warn",
                       f"α {a:.3f} > {TOO_GOOD}: draft {draft.name!r} alone reproduced the target's output "
                       f"on {whole}/{len(auto.stats)} prompts",
                       f"compare `specd generate --draft-model {draft.name}` outputs with the target's on real "
                       f"traffic; if they hold, serve the draft alone for this task (cheaper)", figures)
    plain = sum(g == 0 for s in auto.stats for g in s.draft_lengths)
    steps = sum(len(s.draft_lengths) for s in auto.stats)
    if a < TOO_POOR:
        return Finding("quality", "hurting",
                       f"α {a:.3f} < {TOO_POOR}: speculation is slowing you down ({speedup:.2f}× target-only); "
                       f"AUTO (policy {policy!r}) took {plain}/{steps} steps plainly"
                       + (" — the cost policy drops to γ=0 when E[tokens/step]/(γc+v) < 1" if policy == "cost" else
                          f" — policy {policy!r} never falls back to plain decoding"),
                       "use SPECULATION_MODE_OFF for this task until the draft is distilled"
                       + ("" if policy == "cost" else ", or start the gateway with --policy cost"),
                       figures)
    if speedup < 1:
        return Finding("quality", "hurting", f"α {a:.3f} but AUTO runs at {speedup:.2f}× target-only",
                       "use SPECULATION_MODE_OFF for this task; check the draft's cost (memory finding)", figures)
    return None


def check_temperature(rows: list[tuple[float, Run]], workload_temperature: float) -> Finding:
    """Acceptance and tokens/s at the workload's temperature and lower ones, as a table."""
    table = [{"temperature": t, "alpha": alpha(r), "tokens_per_s": r.result.tokens_per_s} for t, r in rows]
    base = table[0]
    cells = "; ".join(f"T={row['temperature']:.1f}: α {row['alpha']:.3f}, {row['tokens_per_s']:.1f} tokens/s"
                      for row in table)
    figures = {"table": table}
    if len(table) == 1:
        return Finding("temperature", "info", f"greedy workload: {cells}; nothing lower to trade", figures=figures)
    better = [row for row in table[1:] if row["alpha"] >= base["alpha"] + 0.05]
    if better:
        row = better[0]
        return Finding("temperature", "info",
                       f"{cells}: lowering T from {workload_temperature} to {row['temperature']:.1f} raises α by "
                       f"{100 * (row['alpha'] - base['alpha']):.0f} points (outputs less varied)",
                       f"if the product allows: SamplingParams.temperature={row['temperature']:.1f}", figures)
    return Finding("temperature", "ok", f"{cells}: lower temperatures do not raise α much", figures=figures)


def position_acceptance(stats_list, half: int) -> tuple[float, float, int, int]:
    """Acceptance of the draft tokens proposed before and after `half` generated tokens."""
    sums = [[0, 0], [0, 0]]  # early, late: [proposed, accepted]
    for stats in stats_list:
        position = 0
        for proposed, accepted in zip(stats.draft_lengths, stats.accepted_lengths):
            side = sums[position >= half]
            side[0] += proposed
            side[1] += accepted
            position += accepted + 1
    (pe, ae), (pl, al) = sums
    return (ae / pe if pe else 0.0), (al / pl if pl else 0.0), pe, pl


def check_position(auto: Run, max_new_tokens: int) -> Finding:
    half = max(max_new_tokens // 2, 1)
    early, late, n_early, n_late = position_acceptance(auto.stats, half)
    figures = {"early": early, "late": late, "early_tokens": n_early, "late_tokens": n_late, "split": half}
    evidence = (f"accepted/proposed {early:.3f} over the first {half} generated tokens ({n_early} draft tokens), "
                f"{late:.3f} after ({n_late})")
    if n_late and late < early - 0.1:
        return Finding("position", "warn", evidence + ": acceptance falls as the generation grows",
                       "split long generations into shorter steps (the essay's 'task too complex'), or cap "
                       "max_draft_length for this task", figures)
    return Finding("position", "ok", evidence, figures=figures)


def check_short_outputs(target_only: Run, max_new_tokens: int) -> Finding:
    lengths = [s.generated_tokens for s in target_only.stats]
    median = statistics.median(lengths) if lengths else 0
    figures = {"median_generated_tokens": median, "max_new_tokens": max_new_tokens}
    if median < SHORT_OUTPUT:
        return Finding("short outputs", "warn",
                       f"median {median:.0f} generated tokens (< {SHORT_OUTPUT}, max_new_tokens {max_new_tokens}): "
                       f"prefill and warm-up dominate, speculation rarely pays",
                       "serve this task with SPECULATION_MODE_OFF", figures)
    return Finding("short outputs", "ok", f"median {median:.0f} generated tokens", figures=figures)


def check_load_caps(info) -> Finding:
    """AUTO's γ cap at each load level: what the measured costs favour, what is in force."""
    if not info.load_caps:
        return Finding("load caps", "info", "no prior: the workers report no forward costs, or the gateway's "
                       "start-up probes did not run (no draft?); AUTO learns its caps under load")
    cells = ", ".join(f"{row.load}: γ≤{row.cap}" + (f" ({row.origin})" if row.origin not in ("", "prior") else "")
                      for row in info.load_caps)
    figures = {"load_caps": [{"model_pair": r.model_pair, "load": r.load, "prior": r.prior, "cap": r.cap,
                              "learned": r.learned, "origin": r.origin or "prior"} for r in info.load_caps]}
    return Finding("load caps", "info", f"AUTO's cap by sessions in the target's forward, from measured costs "
                   f"unless learned here or shared by other gateways: {cells}", figures=figures)


def check_memory(info, draft) -> Finding:
    if draft.model_free:
        return Finding("memory", "ok", f"{draft.name!r} is model-free: it holds tokens already seen, no weights")
    target_bytes = info.target.parameter_bytes
    share = draft.parameter_bytes / target_bytes if target_bytes else 0.0
    figures = {"draft_bytes": draft.parameter_bytes, "target_bytes": target_bytes, "share": share}
    evidence = (f"draft {draft.name!r} {draft.parameter_bytes / 1e6:.1f} MB next to target {info.target.name!r} "
                f"{target_bytes / 1e6:.1f} MB ({share:.0%})")
    if share > 0.25:
        return Finding("memory", "warn", evidence + ": a draft this large costs too much per token",
                       "use a smaller draft (≤ 10% of the target is usual)", figures)
    return Finding("memory", "ok", evidence, figures=figures)


# -- the run --------------------------------------------------------------------------------

def lower_temperatures(temperature: float) -> list[float]:
    """The workload's temperature, then 0.2 lower steps down to 0 (0.8 → 0.8, 0.6, 0.4, 0.2, 0)."""
    steps = [round(temperature - 0.2 * i, 2) for i in range(int(temperature / 0.2 + 1e-9) + 1)]
    return steps + ([0.0] if steps[-1] > 0 else [])


@dataclass
class Diagnosis:
    """The findings, and what a drift baseline needs: α (conditional acceptance, as the
    gateway's drift detection counts it) under the configured policy, and the draft
    positions it was measured over."""

    findings: list[Finding]
    draft: str
    target: str
    task_types: list[str]
    alpha: float = 0.0
    reached: int = 0

    @property
    def exit_code(self) -> int:
        return max((SEVERITY_EXIT[f.severity] for f in self.findings), default=0)


def diagnose(stub, workload: list[tuple[str, str]], *, temperature: float, max_new_tokens: int,
             draft_model: str = "", prompts_file: str = "PROMPTS.txt", sweep_prompts: int = 4,
             max_gamma: int = MAX_SWEEP, log=None) -> Diagnosis:
    """Run every check against the gateway behind `stub`; `log(text)` reports progress."""
    from specd.v1 import gateway_pb2

    say = log or (lambda text: None)
    info = stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
    findings = check_tokenizers(info)
    usable = [d for d in info.drafts if d.usable]
    if not usable:
        findings.append(Finding("draft", "hurting", "this gateway has no usable draft: every request decodes "
                                "plainly", "start a draft service with a draft sharing the target's tokenizer"))
        return Diagnosis(findings, "", info.target.name, [])
    tasks = sorted({task for task, _ in workload})
    if draft_model and draft_model not in {d.name for d in usable}:
        raise ValueError(f"draft {draft_model!r} is not a usable draft of this gateway; usable: "
                         f"{[d.name for d in usable]}")
    name = draft_model or (info.task_drafts.get(tasks[0], "") if len(tasks) == 1 else "")
    draft = next((d for d in usable if d.name == name), usable[0])
    prober = Prober(stub, workload, max_new_tokens, draft.name)
    gamma = info.default_draft_length
    say(f"doctor: draft {draft.name!r}, target {info.target.name!r}, {len(workload)} prompts")

    plain, fixed = Config("target-only", "off"), Config(f"fixed γ={gamma}", "fixed", "fixed", gamma)
    adaptive = Config("auto", "auto", info.auto_policy)
    if temperature == 0:
        target_only, greedy, auto = prober.compare([plain, fixed, adaptive], warm_up=True)
        plain_at_t = target_only
    else:
        target_only, greedy = prober.compare([plain, fixed], warm_up=True)
        plain_at_t, auto = prober.compare([plain, adaptive], temperature=temperature, warm_up=True)
    top1 = prober.run(fixed, temperature=1.0, top_k=1)
    findings += check_sampling(greedy, top1, target_only)
    say("doctor: sampling probe done")

    card = card_expectation(draft.card_json, tasks, temperature)
    card_gamma = card[1] if card else gamma
    if temperature == 0 and card_gamma == gamma:
        measured = greedy
    else:
        measured = prober.run(Config(f"fixed γ={card_gamma}", "fixed", "fixed", card_gamma),
                              temperature=temperature)
    findings.append(check_acceptance(measured, card, draft, info.target, prompts_file, temperature))
    quality = check_quality(auto, plain_at_t, draft, info.auto_policy)
    if quality is not None:
        findings.append(quality)
    say("doctor: acceptance measured")

    top = min(max_gamma, info.max_draft_length)
    sweep = sweep_gamma(prober, range(1, top + 1), temperature, sweep_prompts)
    findings.append(check_gamma(sweep, auto, info.auto_policy, top))
    say("doctor: γ sweep done")

    temps = lower_temperatures(temperature)
    rows = [(t, measured if t == temperature else
             prober.run(Config(f"fixed γ={card_gamma}", "fixed", "fixed", card_gamma), temperature=t))
            for t in temps]
    findings.append(check_temperature(rows, temperature))
    findings.append(check_position(auto, max_new_tokens))
    findings.append(check_short_outputs(target_only, max_new_tokens))
    findings.append(check_memory(info, draft))
    findings.append(check_load_caps(info))
    return Diagnosis(findings, draft.name, info.target.name, tasks, alpha(auto), reached(auto))


def load_workload(path: str | None, task: str) -> list[tuple[str, str]]:
    """(task type, prompt) pairs: a JSON {task: [prompts]} file, a text file with one prompt per
    line, or the demo workload; --task keeps only that task (and labels a text file's prompts)."""
    if path is not None and not path.endswith(".json"):
        lines = [line.replace("\\n", "\n") for line in Path(path).read_text().splitlines() if line.strip()]
        table = {task: lines}
    else:
        table = json.loads(Path(path).read_text()) if path else DEMO_WORKLOAD
        table = {t: prompts for t, prompts in table.items() if not task or t == task}
    pairs = [(t, p) for t, prompts in table.items() for p in prompts]
    if not pairs:
        raise ValueError(f"no prompts for task {task!r} in {path or 'the demo workload'}; tasks there: "
                         f"{sorted(table)}")
    return pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--prompts", metavar="FILE",
                        help="workload: JSON {task_type: [prompts]} or text, one prompt per line (\\n for newlines); "
                             "default: the demo workload")
    parser.add_argument("--task", default="", help="diagnose this task type only (and label a text file's prompts)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the workload's temperature (0: greedy)")
    parser.add_argument("--draft-model", default="",
                        help="diagnose this hosted draft (default: the task map's draft, else the default draft)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per diagnostic request")
    parser.add_argument("--sweep-prompts", type=int, default=4, help="prompts per γ in the draft-length sweep")
    parser.add_argument("--max-gamma", type=int, default=MAX_SWEEP,
                        help=f"largest γ swept (default {MAX_SWEEP}, bounded by the gateway's maximum)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--report", metavar="DIR", help="write findings.json and plots here")
    parser.add_argument("--write-baseline", metavar="FILE",
                        help="write the measured α (conditional acceptance) as a pinned drift baseline (gateway "
                             "--acceptance-baseline FILE)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    add_client_arguments(parser)
    add_api_key_argument(parser)  # the key's segment must be specd-doctor (docs/reliability.md)


def run(args: argparse.Namespace) -> int:
    """`specd doctor`: print the findings; exit 0 healthy, 1 warnings, 2 speculation hurting."""
    import grpc

    from specd.v1 import gateway_pb2_grpc

    try:
        workload = load_workload(args.prompts, args.task)
    except (OSError, ValueError) as exc:
        print(f"specd doctor: {exc}", file=sys.stderr)
        return 2
    progress = (lambda text: print(text, file=sys.stderr)) if not args.json else None
    with client_channel(args.gateway, client_tls_from_args(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        try:
            diagnosis = diagnose(stub, workload, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                 draft_model=args.draft_model, prompts_file=args.prompts or "PROMPTS.txt",
                                 sweep_prompts=args.sweep_prompts, max_gamma=args.max_gamma, log=progress)
        except grpc.RpcError as exc:
            print(f"specd doctor: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"specd doctor: {exc}", file=sys.stderr)
            return 2
    document = {"gateway": args.gateway, "target": diagnosis.target, "draft": diagnosis.draft,
                "task_types": diagnosis.task_types, "temperature": args.temperature,
                "alpha": diagnosis.alpha, "exit_code": diagnosis.exit_code,
                "findings": [asdict(f) for f in diagnosis.findings]}
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(f.line() for f in diagnosis.findings))
    if args.write_baseline:
        write_baseline(Path(args.write_baseline), diagnosis)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "findings.json").write_text(json.dumps(document, indent=2))
        plots(diagnosis, out)
    return diagnosis.exit_code


def write_baseline(path: Path, diagnosis: Diagnosis) -> None:
    """The measured α under the configured policy (what production runs) as the gateway's
    pinned drift baseline, for each diagnosed task type."""
    pair = model_pair_label(diagnosis.draft, diagnosis.target)
    rows = [(pair, task, diagnosis.alpha, diagnosis.reached) for task in diagnosis.task_types]
    path.write_text(json.dumps(baseline_document(rows), indent=2))


def plots(diagnosis: Diagnosis, out: Path) -> list[str]:
    """PNG plots of the γ sweep and the temperature table; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {f.check: f.figures for f in diagnosis.findings}
    names = []
    sweep = figures.get("draft length", {}).get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["gamma"] for r in sweep], [r["tokens_per_s"] for r in sweep], marker="o", label="tokens/s")
        ax2 = ax.twinx()
        ax2.plot([r["gamma"] for r in sweep], [r["tokens_per_step"] for r in sweep], marker="s", color="tab:orange",
                 label="tokens/step")
        ax.set(xlabel="γ (draft tokens per step)", ylabel="tokens/s", title=f"γ sweep: {diagnosis.draft}")
        ax2.set_ylabel("tokens per step")
        fig.tight_layout()
        fig.savefig(out / "gamma_sweep.png", dpi=100)
        names.append("gamma_sweep.png")
    table = figures.get("temperature", {}).get("table")
    if table and len(table) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["temperature"] for r in table], [r["alpha"] for r in table], marker="o")
        ax.set(xlabel="temperature", ylabel="α (accepted ÷ reached)", title="α vs temperature", ylim=(0, 1.05))
        fig.tight_layout()
        fig.savefig(out / "temperature.png", dpi=100)
        names.append("temperature.png")
    plt.close("all")
    return names
