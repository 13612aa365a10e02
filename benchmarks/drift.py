"""Keeping the draft fresh while traffic moves between domains (issue 33, Deliver 7), on the toy target.

Nights of simulated traffic (default: numbers, numbers, words, facts, facts) are drawn from the toy chat
generator (``specdraft.toy.conversations``), split into domains by the task of each chat's first user turn:
``numbers`` (arithmetic, numbers in words, counting), ``words`` (word games, sorting) and ``facts`` (made-up
countries, animals, colours, greetings; later turns may switch task, as real traffic does). A night's window is
``--conversations`` chats of its domain, deduplicated by prompt (``specdraft.freshness.traffic.prompt_hash``, as the
traffic window is); its held-out slice is ``--questions`` prompts of the same domain from another seed, none of
them in any window. Four arms, all the default recipe (``beagle3``, ``specdraft.configs.train.TrainConfig``) set
up by ``specdraft.run.build_run`` (``benchmarks.recipe_training.train_recipe``) on a feature store of the
window (``benchmarks.toy_data.build_store``):

* ``static``: the night-1 draft, never retrained;
* ``scratch``: every night from scratch on that night's window, ``--scratch-epochs`` epochs;
* ``warm``: every night from the arm's previous draft (``train.init_from``: its weights and draft vocabulary
  kept, ``specdraft.run.feature_plan``/``load_warm``), ``--warm-epochs`` epochs on the window;
* ``replay``: as ``warm``, the window plus a replay share (``--replay``, default ``data.traffic.replay``) of
  earlier nights' windows, sampled with the seed.

Night 1 trains once (from scratch): every arm starts from that draft. Per night and arm: tau (tokens per target
forward, bonus counted; our decoder, greedy, the evaluation's default decoding: ``DecodeConfig`` tree) on the
night's held-out slice and on the regression set (the held-out slices of every earlier night, pooled), the
prompt-lookup floor tau on the same turns, lossless checks, and training compute (optimizer steps, trained
loss-mask tokens, training-loop wall and CPU seconds). ``replay``'s previous draft (the arm's champion) is also
measured on the new window, and the promotion gate (``specdraft.freshness.gate.decide``, ``GateSettings`` defaults) is
applied to each of its candidates — reported, not acted on: every warm night starts from the previous draft.

Goals (issue 33): on each new domain warm+replay reaches >= 95 % of from-scratch tau at <= 40 % of its training
compute (trained tokens), and loses <= 2 % against the previous champion on the regression set; the static
draft's fall is shown. The goals are checked on the point values and reported as met or not, beside 95 %
bootstrap intervals (questions resampled; paired for the ratios and changes: both drafts on the same questions);
the epochs are settings, not tuned (a warm night's budget is the 40 % the goal allows, replay included).

    python -m benchmarks.drift benchmarks/results/drift_cpu.json [--work runs/bench-drift] [--nights ...]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.recipe_training import SHARED, train_recipe
from benchmarks.speculative import bootstrap_tau
from benchmarks.toy_data import build_store, write_questions

ARMS = ("static", "scratch", "warm", "replay")
# the task of a chat's first user turn (specdraft.toy.conversations FIRST_TURNS) -> its domain
DOMAINS = {
    "numbers": re.compile(r"^(?:(?:What is|Calculate|Please compute) \d+ [-+*] \d+|Write the number \d+|"
                          r"List the numbers|Count from|Count down|List the even numbers)"),
    "words": re.compile(r"^(?:Spell the word|Reverse the word|Repeat the word|Write [a-z]+ in capital letters|"
                        r"How many letters are in the word|Sort these)"),
    "facts": re.compile(r"^(?:What is the capital|Which country|What language|Tell me about|What sound|"
                        r"How many legs|Where does|What color|What is the color|Hello|Hi|Good morning|Hey)"),
}


def domain_of(chat: list[dict[str, str]]) -> str:
    """The domain of a toy chat: the task of its first user turn."""
    first = next(m["content"] for m in chat if m["role"] == "user")
    found = [name for name, pattern in DOMAINS.items() if pattern.match(first)]
    assert len(found) == 1, f"first turn {first!r} matches domains {found}"
    return found[0]


def domain_chats(domain: str, n: int, seed: int, exclude: set[str]) -> list[list[dict[str, str]]]:
    """The first ``n`` toy chats of ``domain`` drawn with ``seed``, unique by prompt and none in ``exclude``."""
    from specdraft.toy.conversations import generate_conversation
    from specdraft.freshness.traffic import prompt_hash

    rng, seen, out = random.Random(seed), set(exclude), []
    for _ in range(200 * n):
        chat = generate_conversation(rng)
        key = prompt_hash(chat)
        if domain_of(chat) == domain and key not in seen:
            seen.add(key)
            out.append(chat)
            if len(out) == n:
                return out
    raise RuntimeError(f"only {len(out)} distinct {domain} chats in {200 * n} draws (seed {seed})")


def train(args: argparse.Namespace, store: Path, target: Path, out: Path, epochs: int,
          init_from: str | None) -> dict[str, Any]:
    """One training run (``train_recipe``: ``build_run`` as a one-rank worker), its compute and its vocabulary."""
    from specdraft.plan import draft_vocab_ids

    shutil.rmtree(out, ignore_errors=True)  # a kept draft_vocab.json would be reused
    shared = {k: getattr(args, k, None) for k in SHARED}
    shared.update(epochs=epochs, init_from=init_from)
    r = train_recipe(shared, args.recipe, str(store), str(target), str(out))
    vocab = r["vocab_plan"] or {}
    record = {k: r[k] for k in ("epochs", "train_sequences", "optimizer_steps", "train_tokens", "train_s", "cpu_s",
                                "draft_vocab_size", "draft")}
    record.update(sim_tau_before=r["sim_before"]["sim_tau"], sim_tau_after=r["sim_after"]["sim_tau"],
                  init_from=init_from, vocab_coverage=vocab.get("coverage"),
                  warm_start_fallback=vocab.get("warm_start_fallback"))
    if init_from:
        record["vocab_identical_to_init"] = draft_vocab_ids(r["draft"]) == draft_vocab_ids(init_from)
    return record


class Evaluator:
    """Our decoder's records per (draft, held-out file), each pair decoded once (``run_eval``)."""

    def __init__(self, target: Path, args: argparse.Namespace, work: Path):
        from specdraft.configs.evaluation import EvalSettings
        from specdraft.configs.decode import DecodeConfig

        self.target, self.records = target, {}
        self.settings = EvalSettings(decode=DecodeConfig(max_new_tokens=args.max_new_tokens), device="cpu",
                                     seed=args.seed, workers=1, baselines=str(work / "baselines"))
        self.seconds = 0.0

    def measure(self, draft: str, files: list[Path]) -> None:
        from specdraft.evaluation.run import run_eval

        todo = [f for f in files if (draft, f.stem) not in self.records]
        if not todo:
            return
        t0 = time.perf_counter()
        report = run_eval(self.target, draft, todo, self.settings, progress=False)
        self.seconds += time.perf_counter() - t0
        for f in todo:
            self.records[(draft, f.stem)] = [r for r in report["records"] if r["dataset"] == f.stem]

    def summary(self, draft: str, files: list[Path]) -> dict[str, Any] | None:
        """tau, the floor and the lossless count over the turns of ``files`` pooled (None: no file)."""
        from specdraft.decoding.metrics import summarize

        if not files:
            return None
        rows = self.turns(draft, files)
        s = summarize(rows)
        return {"tau": _r(s["tau"]), "tau_ci95": bootstrap_tau(rows), "tau_pld": _r(s["tau_pld"]),
                "turns": s["num_turns"],
                "lossless": f"{s['lossless_checked'] - s['lossless_mismatches']}/{s['lossless_checked']}"}

    def turns(self, draft: str, files: list[Path]) -> list[dict[str, Any]]:
        """The per-turn records of ``draft`` on ``files``, each question keyed (file, question id) as ``index``."""
        self.measure(draft, files)
        return [{**r, "index": (f.stem, r["question_id"])} for f in files for r in self.records[(draft, f.stem)]]


def paired_ratio_ci(a: list[dict[str, Any]], b: list[dict[str, Any]], samples: int = 2000,
                    seed: int = 0) -> list[float]:
    """95 % interval of tau(a) / tau(b) on the same questions, resampled together with replacement."""
    sums = {}
    for col, records in enumerate((a, b)):
        for r in records:
            acc = sums.setdefault(r["index"], [0, 0, 0, 0])
            acc[2 * col] += r["round_tokens"]
            acc[2 * col + 1] += r["rounds"]
    totals = np.array(list(sums.values()), dtype=np.float64)  # (Q, 4): a tokens, a rounds, b tokens, b rounds
    picks = np.random.default_rng(seed).integers(0, len(totals), size=(samples, len(totals)))  # (samples, Q)
    s = totals[picks].sum(axis=1)  # (samples, 4)
    ratios = (s[:, 0] / np.maximum(s[:, 1], 1)) / (s[:, 2] / np.maximum(s[:, 3], 1))
    return [round(float(x), 3) for x in np.percentile(ratios, [2.5, 97.5])]


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _change(new: float | None, old: float | None) -> float | None:
    return None if new is None or not old else round((new - old) / old, 4)


def summarize_nights(nights: list[dict[str, Any]]) -> dict[str, Any]:
    """Warm+replay against scratch per night (tau ratio, compute shares, regression vs its champion), the
    static draft's fall, and the goals."""
    per_night, static_first = [], nights[0]["arms"]["static"]["window"]["tau"]
    for n in nights[1:]:
        a = n["arms"]
        rep, scr = a["replay"], a["scratch"]
        row = {"night": n["night"], "domain": n["domain"], "new_domain": n["new_domain"],
               "replay_over_scratch_tau": _r(rep["window"]["tau"] / scr["window"]["tau"]),
               "replay_over_scratch_tau_ci95": n["over_scratch_ci95"]["replay"],
               "warm_over_scratch_tau": _r(a["warm"]["window"]["tau"] / scr["window"]["tau"]),
               "warm_over_scratch_tau_ci95": n["over_scratch_ci95"]["warm"],
               "replay_compute_share": {k: _r(rep["train"][k] / scr["train"][k], 3)
                                        for k in ("train_tokens", "optimizer_steps", "train_s", "cpu_s")},
               "warm_compute_share": {k: _r(a["warm"]["train"][k] / scr["train"][k], 3)
                                      for k in ("train_tokens", "optimizer_steps", "train_s", "cpu_s")},
               "replay_regression_change": rep["regression_vs_previous"],
               "replay_regression_change_ci95": rep["regression_vs_previous_ci95"],
               "warm_regression_change": a["warm"]["regression_vs_previous"],
               "static_window_tau_change_vs_night1": _change(a["static"]["window"]["tau"], static_first),
               "static_over_scratch_tau": _r(a["static"]["window"]["tau"] / scr["window"]["tau"]),
               "gate": n["gate"]["promote"]}
        per_night.append(row)
    new = [r for r in per_night if r["new_domain"]]
    goals = {
        "tau": {"goal": "replay tau >= 95% of scratch tau on each new domain",
                "values": {r["night"]: r["replay_over_scratch_tau"] for r in new},
                "met": all(r["replay_over_scratch_tau"] >= 0.95 for r in new)},
        "compute": {"goal": "replay training compute (trained tokens) <= 40% of scratch's on each new domain",
                    "values": {r["night"]: r["replay_compute_share"]["train_tokens"] for r in new},
                    "met": all(r["replay_compute_share"]["train_tokens"] <= 0.40 for r in new)},
        "regression": {"goal": "replay loses <= 2% tau on the regression set against its previous draft (the "
                               "champion), every night",
                       "values": {r["night"]: r["replay_regression_change"] for r in per_night},
                       "met": all(r["replay_regression_change"] >= -0.02 for r in per_night)},
    }
    return {"per_night": per_night, "goals": goals, "all_goals_met": all(g["met"] for g in goals.values())}


def print_table(result: dict[str, Any]) -> None:
    head = (f"{'night':5s} {'domain':8s} {'arm':8s} {'steps':>5s} {'tokens':>7s} {'train s':>7s} "
            f"{'window tau':>10s} {'pld':>5s} {'regr tau':>8s} {'pld':>5s} {'regr vs prev':>12s} {'lossless':>9s}")
    print(head)
    print("-" * len(head))
    for n in result["nights"]:
        for arm, a in n["arms"].items():
            t = a["train"] or {}
            reg = a["regression"] or {}
            lossless = a["window"]["lossless"] + ("" if not reg else f"+{reg['lossless']}")
            shared = " (shared)" if a.get("same_draft_as") else ""
            print(f"{n['night']:5d} {n['domain']:8s} {arm:8s} {t.get('optimizer_steps', 0):5d} "
                  f"{t.get('train_tokens', 0):7d} {t.get('train_s', 0.0):7.1f} {a['window']['tau']:10.3f} "
                  f"{a['window']['tau_pld']:5.2f} {reg.get('tau') or float('nan'):8.3f} "
                  f"{reg.get('tau_pld') or float('nan'):5.2f} "
                  f"{'' if a['regression_vs_previous'] is None else format(a['regression_vs_previous'], '+.1%'):>12s}"
                  f" {lossless:>9s}{shared}")
        if n["gate"]:
            print(f"{'':5s} gate (replay candidate vs its champion): {n['gate']['reason']}")
    print("tau: tokens per target forward (bonus counted), greedy, tree decoding; pld: prompt-lookup floor on the "
          "same turns; regr: the earlier nights' held-out slices pooled; regr vs prev: against the arm's previous "
          "draft on the same set")
    for row in result["summary"]["per_night"]:
        print(f"night {row['night']} ({row['domain']}{', new domain' if row['new_domain'] else ''}): replay/scratch "
              f"tau {row['replay_over_scratch_tau']:.3f} {row['replay_over_scratch_tau_ci95']} at "
              f"{row['replay_compute_share']['train_tokens']:.0%} of its "
              f"tokens ({row['replay_compute_share']['train_s']:.0%} of its seconds); warm/scratch "
              f"{row['warm_over_scratch_tau']:.3f} {row['warm_over_scratch_tau_ci95']} at "
              f"{row['warm_compute_share']['train_tokens']:.0%}; static "
              f"{row['static_window_tau_change_vs_night1']:+.1%} vs night 1 ({row['static_over_scratch_tau']:.3f} "
              f"of scratch); replay on the regression set {row['replay_regression_change']:+.1%} "
              f"{row['replay_regression_change_ci95']}")
    for name, g in result["summary"]["goals"].items():
        print(f"goal {name}: {'MET' if g['met'] else 'NOT MET'} ({g['goal']}): {g['values']}")
    load = result["host"]["load"]
    print(f"load avg (1m): min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']} on "
          f"{load['cpus']} CPUs; total {result['total_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    # Long on purpose: the benchmark's script, night by night; the nights share the drafts, stores and records.
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON result path")
    ap.add_argument("--work", default="runs/bench-drift", help="target, stores, drafts, questions")
    ap.add_argument("--nights", default="numbers,numbers,words,facts,facts", help=f"one domain a night: {list(DOMAINS)}")
    ap.add_argument("--recipe", default=None, help="the recipe every arm trains (default: TrainConfig's, beagle3)")
    ap.add_argument("--conversations", type=int, default=400, help="window chats a night")
    ap.add_argument("--questions", type=int, default=20, help="held-out prompts a night")
    ap.add_argument("--replay", type=float, default=None, help="replay share of the window (default data.traffic.replay)")
    ap.add_argument("--scratch-epochs", type=int, default=10, help="epochs of a from-scratch night")
    ap.add_argument("--warm-epochs", type=int, default=3, help="epochs of a warm night")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=1000, help="window n is drawn with seed data_seed + n")
    ap.add_argument("--question-seed", type=int, default=4242, help="held-out slice n: question_seed + n")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak lr (the toy quickstart's)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per batch")
    args = ap.parse_args(argv)
    from specdraft.configs.fresh import GateSettings, TrafficSettings
    from specdraft.configs.train import TrainConfig
    from specdraft.features import resolve_aux_layers
    from specdraft.freshness.gate import decide
    from specdraft.plan import aux_layers_setting
    from specdraft.targets.loading import load_target_config
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig
    from specdraft.freshness.traffic import prompt_hash

    nights = [d.strip() for d in args.nights.split(",") if d.strip()]
    assert set(nights) <= set(DOMAINS), f"--nights: unknown domains {sorted(set(nights) - set(DOMAINS))}"
    replay_share = TrafficSettings().replay if args.replay is None else args.replay
    args.recipe = args.recipe or TrainConfig().recipe
    defaults = TrainConfig(recipe=args.recipe)
    # the benchmark's training settings (recipe_training.SHARED): the toy quickstart's lr, TrainConfig's defaults
    args.threads, args.warmup, args.schedule = 1, defaults.optim.warmup_steps, defaults.optim.schedule
    args.min_lr_ratio, args.noise_std, args.sim_depth = defaults.optim.min_lr_ratio, None, defaults.sim_depth
    args.val_fraction, args.draft_vocab = defaults.reader.val_fraction, None
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[drift {time.perf_counter() - started:6.0f}s] {text}", file=sys.stderr, flush=True)

    with LoadSampler() as load:
        target = build_toy_target(work / "target", ToyTargetConfig(), progress=False, prebuilt=True)
        layers = int(load_target_config(target).get_text_config().num_hidden_layers)
        aux = resolve_aux_layers(aux_layers_setting(defaults, None), layers) or []
        windows = [domain_chats(d, args.conversations, args.data_seed + i, set()) for i, d in enumerate(nights, 1)]
        trained = {prompt_hash(c) for w in windows for c in w}
        held_out, seen = [], set(trained)
        for i, d in enumerate(nights, 1):
            chats = domain_chats(d, args.questions, args.question_seed + i, seen)
            seen |= {prompt_hash(c) for c in chats}
            rows = [{"question_id": q, "category": d, "turns": [m["content"] for m in c if m["role"] == "user"]}
                    for q, c in enumerate(chats)]
            held_out.append(write_questions(work / "questions" / f"night{i}_{d}.jsonl", rows))
        evaluator = Evaluator(target, args, work)
        drafts: dict[str, str] = {}
        results: list[dict[str, Any]] = []
        for i, domain in enumerate(nights, 1):
            window = windows[i - 1]
            night: dict[str, Any] = {"night": i, "domain": domain, "new_domain": domain not in nights[:i - 1],
                                     "window_conversations": len(window), "held_out_questions": args.questions}
            say(f"night {i} ({domain}): stores")
            t0 = time.perf_counter()
            store = work / "stores" / f"night{i}"
            night["store"] = build_store(store, target, len(window), args.data_seed + i, 192, 10, 128, aux, chats=window)
            trainings: dict[str, dict[str, Any] | None] = {}
            if i == 1:
                say(f"night 1: training from scratch ({args.scratch_epochs} epochs); every arm starts from it")
                trainings["scratch"] = train(args, store, target, work / "drafts" / "night1-scratch",
                                             args.scratch_epochs, None)
                for arm in ARMS:
                    drafts[arm] = trainings["scratch"]["draft"]
            else:
                windowed = {prompt_hash(c) for c in window}
                pool = [c for w in windows[:i - 1] for c in w if prompt_hash(c) not in windowed]
                pool = list({prompt_hash(c): c for c in pool}.values())
                replayed = random.Random(args.seed + i).sample(pool, min(len(pool), round(replay_share * len(window))))
                night["replayed_conversations"] = len(replayed)
                replay_store = work / "stores" / f"night{i}-replay"
                night["replay_store"] = build_store(replay_store, target, len(window) + len(replayed),
                                                    args.data_seed + i, 192, 10, 128, aux, chats=window + replayed)
                previous = dict(drafts)
                for arm, data, epochs, init in (("scratch", store, args.scratch_epochs, None),
                                                ("warm", store, args.warm_epochs, previous["warm"]),
                                                ("replay", replay_store, args.warm_epochs, previous["replay"])):
                    say(f"night {i}: training {arm} ({epochs} epochs{', warm' if init else ''})")
                    trainings[arm] = train(args, data, target, work / "drafts" / f"night{i}-{arm}", epochs, init)
                    drafts[arm] = trainings[arm]["draft"]
                    say(f"  {trainings[arm]['optimizer_steps']} steps, {trainings[arm]['train_tokens']} tokens, "
                        f"{trainings[arm]['train_s']} s")
            night["stores_and_training_s"] = round(time.perf_counter() - t0, 1)
            say(f"night {i}: decoding (tree) on the window and the regression set")
            files, regression = held_out[:i], held_out[:i - 1]
            arms: dict[str, Any] = {}
            for arm in ARMS:
                draft = drafts[arm]
                evaluator.measure(draft, files)
                prev = results[-1]["arms"][arm] if results else None
                reg = evaluator.summary(draft, regression)
                prev_reg = evaluator.summary(prev["draft"], regression) if prev else None
                arms[arm] = {"draft": draft, "train": trainings["scratch"] if i == 1 else trainings.get(arm),
                             "window": evaluator.summary(draft, files[-1:]), "regression": reg,
                             "regression_vs_previous": _change(reg and reg["tau"], prev_reg and prev_reg["tau"]),
                             "regression_vs_previous_ci95": None if not prev_reg else [
                                 round(x - 1, 3) for x in paired_ratio_ci(evaluator.turns(draft, regression),
                                                                          evaluator.turns(prev["draft"], regression))],
                             **({"same_draft_as": "scratch"} if i == 1 and arm != "scratch" else {})}
            night["arms"] = arms
            if i > 1:  # the arms' window tau against scratch's, questions resampled together
                night["over_scratch_ci95"] = {arm: paired_ratio_ci(evaluator.turns(drafts[arm], files[-1:]),
                                                                   evaluator.turns(drafts["scratch"], files[-1:]))
                                              for arm in ("static", "warm", "replay")}
            night["gate"] = None
            if i > 1:  # the replay arm's candidate against its previous draft, the champion
                champion = results[-1]["arms"]["replay"]["draft"]
                champ_window = evaluator.summary(champion, files[-1:])
                night["champion_window"] = champ_window
                gate = decide(GateSettings(enabled=True), window=(arms["replay"]["window"]["tau"], champ_window["tau"]),
                              regression=(arms["replay"]["regression"]["tau"],
                                          evaluator.summary(champion, regression)["tau"]), has_champion=True)
                night["gate"] = gate.to_dict()
            say(f"night {i}: window tau " + ", ".join(f"{a} {arms[a]['window']['tau']:.3f}" for a in ARMS)
                + f" (pld {arms['static']['window']['tau_pld']:.3f}); eval so far {evaluator.seconds:.0f} s")
            results.append(night)

    result = {
        "benchmark": "drift",
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "replay": replay_share,
                     "aux_layers": aux, "decode": "DecodeConfig defaults (tree, depth 6, topk 10, 60 tokens), greedy",
                     "store": {"max_length": 192, "topk": 10, "samples_per_shard": 128}},
        "target": {"dir": str(target), "config": "ToyTargetConfig() (the shipped prebuilt toy target)"},
        "domains": {name: pattern.pattern for name, pattern in DOMAINS.items()},
        "nights": results,
        "summary": summarize_nights(results),
        "eval_s": round(evaluator.seconds, 1),
        "host": {"threads": 1, "device": "cpu", "load": load.summary()},  # write_result adds the host's facts
        "total_s": round(time.perf_counter() - started, 1),
    }
    path = write_result(args.out, result)
    print_table(result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
