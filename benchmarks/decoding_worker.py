"""One measuring process of ``benchmarks/decoding.py``: vanilla, prompt-lookup, chain and EAGLE-2 tree
decoding of the same prompts with whatever ``specdraft`` is on ``sys.path`` (the decoding loop of the
base commit, "before", or of this tree, "after"), and the cost of the model calls a round is made of.

    python benchmarks/decoding_worker.py SPEC.json OUT.json
    python benchmarks/decoding_worker.py --flow CONFIG WORKDIR OUT.json     (the toy flow, timed by stage)
    python benchmarks/decoding_worker.py --eval CONFIG TARGET DRAFT REPORT OUT.json   (its eval stage again)

It reads only APIs both loops have (``specdraft.decoding``'s generators and configs, ``target_forward``,
the ``Draft`` protocol), so one file measures both. SPEC names the target (a directory, or a random
``shape`` built in memory: the 8B-like GPU check), the draft (a directory, or a random one of ``arch``),
the prompts (token ids), the decode settings, the torch threads and whether to time the components:

* ``step_s``   one vanilla decode step: a target forward of 1 token on the context + argmax;
* ``verify_s`` one verification forward of n tokens with a 4D mask (n = γ+1 for chains and prompt
  lookup, total_tokens+1 for trees);
* ``draft_s``  one draft step: the draft's forward for 1 query (a chain node) or ``topk`` queries
  (a tree level) over the context, with its encodings and log-probabilities.

Each is the median of repeated calls on a context of the prompts' mean length plus half the new
tokens, the cache rolled back between calls, in wall time and process CPU time (a CPU run on a
machine shared with other work: CPU time is the steadier of the two).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch


def _clock(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def load(spec: dict[str, Any]):
    """Target, draft and EOS ids as SPEC says (directories, or random weights of a shape)."""
    from specdraft.decoding import eos_token_ids
    from specdraft.models import build_draft, draft_config_from_target, load_draft
    from specdraft.targets.loading import load_target_model, load_tokenizer

    device = torch.device(spec.get("device", "cpu"))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    target_spec, draft_spec = spec["target"], spec["draft"]
    if "path" in target_spec:
        target = load_target_model(target_spec["path"], dtype=dtype, device=device)
        eos = eos_token_ids(target, load_tokenizer(target_spec["path"]))
    else:  # random weights of a shape (speed only): the 8B-like check on a GPU
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(target_spec.get("seed", 0))
        config = LlamaConfig(**target_spec["shape"], tie_word_embeddings=False, attn_implementation="sdpa")
        with torch.device(device):
            target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
        eos = frozenset()
    if "path" in draft_spec:
        heads = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
        with readable_draft(draft_spec["path"]) as path:
            draft = load_draft(path, device=device, dtype=dtype, heads=heads)
    else:
        torch.manual_seed(draft_spec.get("seed", 1))
        cfg = draft_config_from_target(target.config, draft_spec["arch"])
        draft = build_draft(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
        draft = draft.to(device=device, dtype=dtype).eval()
    return target, draft, eos


@contextmanager
def readable_draft(path: str) -> Iterator[str]:
    """``path``, or a copy of it whose ``config.json`` lacks the keys this ``specdraft``'s ``DraftConfig``
    does not know: a draft saved by a newer tree carries fields (a block draft's ``block_size``,
    ``mask_token_id``, ...) that the "before" loop's config rejects and a chain/tree draft does not use."""
    import dataclasses
    import shutil
    import tempfile

    from specdraft.configs.draft import DraftConfig

    config = json.loads((Path(path) / "config.json").read_text())
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    if set(config) <= known:
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "draft"
        shutil.copytree(path, copy)
        (copy / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k in known}, indent=2))
        yield str(copy)


def generations(target, draft, eos, spec: dict[str, Any]) -> dict[str, Any]:
    """Every decoder on every prompt (the order rotated per prompt), timed per generation."""
    from specdraft.decoding import prompt_lookup_generate, speculative_generate, vanilla_generate
    from specdraft.configs.decode import DecodeConfig, PromptLookupConfig

    device = next(target.parameters()).device
    configs = {name: DecodeConfig(**cfg) for name, cfg in spec["decoders"].items()}
    pld = PromptLookupConfig()

    def run(name: str, prompt: list[int]):
        cfg = configs[name]
        if name == "vanilla":
            return vanilla_generate(target, prompt, cfg, eos)
        if name == "pld":
            return prompt_lookup_generate(target, prompt, cfg, pld, eos)
        return speculative_generate(target, draft, prompt, cfg, eos)

    for name in configs:  # warm-up: first-call costs out of the timings
        run(name, spec["prompts"][0][:16])
    names = list(configs)
    out = {name: {"tokens": 0, "rounds": 0, "round_tokens": 0, "wall_s": 0.0, "cpu_s": 0.0, "draft_s": 0.0,
                  "verify_s": 0.0, "answers": []} for name in names}
    for i, prompt in enumerate(spec["prompts"]):
        for name in names[i % len(names):] + names[: i % len(names)]:
            wall, cpu = _clock(device)
            gen = run(name, prompt)
            wall2, cpu2 = _clock(device)
            row = out[name]
            row["tokens"] += len(gen.tokens)
            row["rounds"] += gen.rounds
            row["round_tokens"] += sum(gen.round_tokens) if gen.round_tokens else 0
            row["wall_s"] += wall2 - wall
            row["cpu_s"] += cpu2 - cpu
            row["draft_s"] += gen.draft_s
            row["verify_s"] += gen.verify_s
            row["answers"].append(gen.tokens)
    return out


def _median_call(fn, device: torch.device, calls: int) -> tuple[float, float]:
    walls, cpus = [], []
    for i in range(calls + 3):
        wall, cpu = _clock(device)
        fn()
        wall2, cpu2 = _clock(device)
        if i >= 3:
            walls.append(wall2 - wall)
            cpus.append(cpu2 - cpu)
    return statistics.median(walls), statistics.median(cpus)


@torch.no_grad()
def components(target, draft, spec: dict[str, Any]) -> dict[str, Any]:
    """The model calls a round is made of, timed alone (see the module docstring), with the attention
    kernels the loop decodes with."""
    device = next(target.parameters()).device
    try:  # the kernels the loop decodes with (a loop that has no choice: the defaults)
        from specdraft.models.layers import decoding_attention
    except ImportError:
        decoding_attention = None
    with decoding_attention(device) if decoding_attention else nullcontext():
        return _components(target, draft, spec, device)


def _components(target, draft, spec: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from transformers import DynamicCache

    from specdraft.decoding.verify import target_forward

    dtype = next(target.parameters()).dtype
    calls = spec.get("calls", 30)
    prompt = max(spec["prompts"], key=len)
    length = int(statistics.mean(len(p) for p in spec["prompts"])) + spec["max_new_tokens"] // 2
    ids = torch.tensor([(prompt * (length // len(prompt) + 1))[:length]], device=device)  # (1, L)
    cache = DynamicCache()
    hidden, _ = target_forward(target, ids, torch.arange(length, device=device)[None], cache)

    def forward(n: int):
        tokens = ids[:, :n]
        positions = torch.arange(length, length + n, device=device)[None]
        mask = torch.zeros(1, 1, n, length + n, dtype=dtype, device=device)
        mask[..., length:] = torch.full((n, n), torch.finfo(dtype).min, device=device).triu(1)
        _, logits = target_forward(target, tokens, positions, cache, mask if n > 1 else None)
        logits[0].argmax(-1)
        cache.crop(-n)  # back to the context

    out = {"context": length}
    out["step_s"] = _median_call(lambda: forward(1), device, calls)
    out["verify_s"] = {str(n): _median_call(lambda n=n: forward(n), device, calls) for n in spec["verify_sizes"]}
    # the draft: its entries for the committed context, then queries over them
    states = draft.project(hidden.to(dtype))  # (1, L, d)
    _, kv = draft.encode_committed(ids, states[:, :-1], 0)  # (1, L) tokens, L-1 states

    def draft_step(q: int):
        pos = torch.full((1, q), length, device=device)
        x, extra = draft.encode_nodes(ids[:, :q], states[:, :q], pos)
        keys = kv if extra is None else kv.cat(extra)
        visible = None if q == 1 else torch.ones(1, q, keys.length, dtype=torch.bool, device=device)  # a chain: none
        h = draft.attend(x, pos, keys, visible)
        draft.encode_drafted(h, pos)
        torch.log_softmax(draft.logits(h).float(), -1).argmax(-1)

    out["draft_s"] = {str(q): _median_call(lambda q=q: draft_step(q), device, calls) for q in spec["draft_queries"]}
    return out


def flow(config: str, workdir: str, out: str) -> None:
    """The regenerate-and-train flow on ``config`` in ``workdir``; its stage records to ``out``."""
    from flows.local_api import local_prefect_api
    from flows.regenerate_and_train import regenerate_and_train

    with local_prefect_api(workdir):  # as ``specdraft run`` does
        result = regenerate_and_train(config, [f"workdir={workdir}"])
    Path(out).write_text(json.dumps(result, default=str) + "\n")


def evaluate_again(config: str, target: str, draft: str, report: str, out: str, *overrides: str) -> None:
    """The eval stage of ``config`` (plus ``key=value`` ``overrides``) on ``draft`` with the
    ``pipelines.evaluate`` of the code on sys.path (the after code reads the baselines the flow's eval
    stage wrote beside its reports)."""
    import inspect

    from pipelines.evaluate import evaluate
    from pipelines.configs import RunConfig
    from specdraft.config import load

    cfg = load(RunConfig, config, [f"workdir={Path(report).parents[2]}", *overrides])
    extra = {}
    if "baselines_home" in inspect.signature(evaluate).parameters:
        extra["baselines_home"] = Path(cfg.workdir) / "eval" / "baselines"
    started = time.perf_counter()
    with readable_draft(draft) as path:
        evaluate(target, path, cfg.eval.questions, report, cfg.eval.settings, progress=False, **extra)
    Path(out).write_text(json.dumps({"eval_s": time.perf_counter() - started}) + "\n")


def main(argv: list[str]) -> int:
    if argv[0] == "--flow":
        flow(*argv[1:])
        return 0
    if argv[0] == "--eval":
        evaluate_again(*argv[1:])
        return 0
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(spec.get("threads", 1))
    load_before = os.getloadavg()
    target, draft, eos = load(spec)
    if spec.get("ignore_eos"):  # every generation runs to max_new_tokens: the steady state, not the prefill
        eos = frozenset()
    import specdraft

    result = {"specdraft": str(Path(specdraft.__file__).parent), "load_before": load_before}  # which loop ran
    result["decoders"] = generations(target, draft, eos, spec)
    if spec.get("components"):
        result["components"] = components(target, draft, spec)
    result["load_after"] = os.getloadavg()
    # a record for decoding.py (which writes the result), not a result: written here by hand, since the "before"
    # commit's tree is on sys.path and its benchmarks.host may have no write_result
    Path(argv[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
