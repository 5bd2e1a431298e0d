"""Multi-turn RL with tools and environments (issue 46) in TRL 1.16's contract, token-in/token-out.

Without ranks: the tool loop (harness/rl/multiturn.py) driven by a scripted generator (fixed token ids per turn, the
generator contract of harness/rl/generation) on the built-in byte-level BPE tokenizer under Qwen2.5's template: the
ids trained are the ids sampled plus the template's tool suffix ids, on a tokenizer where re-tokenizing the text
changes them; each finish reason (eos, length, budget with the tool results rolled back, max_iterations, error);
TRL's error texts; get_reward and environments=; an environment served over HTTP on 127.0.0.1; the refusals
before launch (one through harness/run.py: exit 2).

One 2-rank launch (tests/helpers/launch.py launch_jobs):
- the fixed multi-turn batch of tests/helpers/grpo_ref.py (turns, tool suffixes, truncated rollouts) replayed on
  ZeRO-2 (dapo), ZeRO-3 (grpo, beta 0.04 with a ZeRO-3 reference, temperature 0.7) and ZeRO-1 (bnpo,
  mask_truncated_completions, perturbed old_logps: the clip metrics): loss, grad norm and clip metrics of two steps
  equal the plain-torch GRPO with the tool tokens masked, and differ from it unmasked;
- the toy environment (tests/fixtures/rl_tools/secret_env.py: reward 1 once the tool reveal() ran) live on ZeRO-3,
  its rows taking different numbers of turns on the two ranks: it finishes and equals one rank (a plain process);
  a run stopped inside a generation and resumed equals it (losses, rollouts.jsonl byte for byte); rl.replay of its
  rollouts.jsonl reproduces its losses bit for bit with no environment.
The toy task learns, in the same plain process as the one-rank run: the default tool model (untrained: a reveal call
in ~12% of rollouts) on SecretEnv alone, 12 steps of 32 rollouts (4 prompts x 8), one round of tool calls and 48
tokens at most (a call's suffix then fills the budget: no long rollouts to drift into), AdamW at lr 5e-3. Measured
over train.seed 1-7 (the test runs seed 1): the mean reward of the last 4 steps 0.49-0.59 (first 2 steps 0.14-0.28),
tools/call_frequency 1.35-1.77 (0.06-0.59); at lr 1e-12 (seeds 1-3) 0.10-0.125 and 0.14-0.22. The test asserts the
last 4 steps' reward >= 0.3 and 0.15 above the first 2 steps', and call frequency >= 0.7: lr 1e-12 fails it. lr 1e-2
is past the edge (2 of 3 seeds learn to stop ending their turns: 45 of 48 tokens, reward ~0.1).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from harness.errors import UsageError
from helpers.grpo_ref import Case, close, expected, perturbed_old, tool_records, write_replay
from helpers.launch import launch_jobs, records as metric_records
from helpers.models import llama_folder, perturbed_folder
from helpers.tool_models import (ENV_FILE, SECRETS, Scripted, call_text, pieces as _ids, second_rank_records,
                                 tool_model_folder, tool_tokenizer, write_prompts)

RL = {"max_completion_length": 96, "max_tool_calling_iterations": None, "chat_template_kwargs": {},
      "tool_timeout_s": None, "max_tool_result_tokens": None, "reward_errors": "stop", "temperature": 1.0}
PROMPT = [{"role": "user", "content": "What is the secret word? Ask the tool."}]


def _loop(script, rl=None, tools=(f"{ENV_FILE}:broken",), env=f"{ENV_FILE}:SecretEnv"):
    from harness.rl.multiturn import MultiTurn
    from harness.rl.tools import load_toolbox

    rl = {**RL, **(rl or {}), "tools": list(tools), "environment_factory": env}
    tok, box = tool_tokenizer(), load_toolbox(rl, Path.cwd())
    gen = Scripted(script)
    loop = MultiTurn(rl, tok, box, gen)
    prompt_ids = tok.apply_chat_template(PROMPT, tools=box.schemas[None], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
    rows = loop.start([PROMPT] * len(script), [prompt_ids] * len(script), {"secret": list(SECRETS[:len(script)])},
                      list(range(len(script))), [f"row {i}" for i in range(len(script))])
    loop.run(rows, seed=1)
    _loop.box = box  # the classes the rows' environments are instances of
    return tok, rows, gen


def test_trained_ids_are_the_sampled_ones_plus_the_templates_tool_suffix(tmp_path):
    tok = tool_tokenizer()
    reveal, eos = tok.convert_tokens_to_ids(call_text("reveal")), tok.eos_token_id
    first, second = _ids(tok, "the ") + [reveal, eos], _ids(tok, "the secret") + [eos]
    _, (row,), gen = _loop([[first, second]])
    assert row.finish == "eos" and row.rounds == 1 and row.environment.revealed
    suffix = row.completion[len(first):len(row.completion) - len(second)]
    assert row.completion == first + suffix + second and row.tool_mask == [1] * len(first) + [0] * len(suffix) + \
        [1] * len(second)
    # the suffix is the template's own rendering of the tool message, after the assistant turn's EOS
    convo = PROMPT + [row.replies[0], {"role": "tool", "name": "reveal", "content": SECRETS[0]}]
    text = tok.apply_chat_template(convo, tools=[_schema(s) for s in ("broken", "reveal")], tokenize=False,
                                   add_generation_prompt=True)
    # (the template would write the parsed reply as "the\n<tool_call>..."; the sampled "the <tool_call>..." is kept)
    assert text.startswith(tok.decode(row.prompt_ids)) and text.endswith("</tool_call><|im_end|>" + tok.decode(suffix))
    assert tok.decode(suffix) == f"\n<|im_start|>user\n<tool_response>\n{SECRETS[0]}\n</tool_response><|im_end|>\n" \
                                 "<|im_start|>assistant\n"
    # re-tokenizing the conversation would train other ids than the sampled ones (BPE is not a bijection)
    assert tok(tok.decode(row.completion), add_special_tokens=False)["input_ids"] != row.completion
    assert row.logps == [-0.5] * len(first) + [0.0] * len(suffix) + [-0.5] * len(second)
    assert row.turns[0]["tool_calls"] == [{"name": "reveal", "arguments": {}}]
    assert row.turns[0]["tool_results"] == [SECRETS[0]] and gen.calls[1] == ([0], 96 - len(first) - len(suffix))


def _schema(name):
    from harness.rl.tools import load_toolbox

    box = load_toolbox({"tools": [f"{ENV_FILE}:broken"], "environment_factory": f"{ENV_FILE}:SecretEnv"}, Path.cwd())
    return next(s for s in box.schemas[None] if s["function"]["name"] == name)


def test_each_finish_reason_and_trls_error_texts():
    tok = tool_tokenizer()
    reveal, broken = (tok.convert_tokens_to_ids(call_text(n)) for n in ("reveal", "broken"))
    eos = tok.eos_token_id
    a = _ids(tok, "ab")
    script = [[a + [eos]],  # eos: no tool call
              [a * 120],  # length: cut by the budget
              [a + [broken, eos], a + [reveal, eos], a + [reveal, eos]],  # capped: the third turn's call not run
              [a * 80 + [reveal, eos]]]  # budget: 162 + the suffix (43) > 200, the result rolled back
    _, rows, gen = _loop(script, {"max_tool_calling_iterations": 2, "max_completion_length": 200})
    assert [r.finish for r in rows] == ["eos", "length", "max_iterations", "budget"], [r.finish for r in rows]
    assert len(rows[1].completion) == 200 and rows[1].tool_mask == [1] * 200
    assert rows[2].rounds == 2 and rows[2].calls == 2 and rows[2].failures == 1
    assert rows[2].turns[0]["tool_results"] == [str({"error": "broken cannot take 'x'"})]  # TRL's error message
    assert rows[3].turns[0].get("rolled_back") and rows[3].tool_mask == [1] * len(rows[3].completion)
    assert rows[3].environment.revealed  # the call ran (TRL runs it, then rolls its result back)
    assert [len(ids) for ids, _ in gen.calls] == [4, 1, 1]  # lockstep: one generate per turn for the rows going


def test_an_unknown_tool_and_a_timeout_under_each_rl_reward_errors_rule(tmp_path):
    tool = tmp_path / "calls.py"
    tool.write_text("import time\n\ndef ask(word: str) -> str:\n    \"\"\"Ask.\n\n    Args:\n        word: a word.\n"
                    "    \"\"\"\n    time.sleep(2)\n    return word\n")
    tok = tool_tokenizer()
    tok.add_tokens(['<tool_call>\n{"name": "ask", "arguments": {"word": "hi"}}\n</tool_call>',
                    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'])
    ask, nope = len(tok) - 2, len(tok) - 1
    from harness.rl.multiturn import MultiTurn
    from harness.rl.tools import load_toolbox

    for rule in ("zero", "stop"):
        rl = {**RL, "tools": [f"{tool}:ask"], "environment_factory": None, "tool_timeout_s": 0.2,
              "reward_errors": rule}
        loop = MultiTurn(rl, tok, load_toolbox(rl, Path.cwd()), Scripted([[[nope, tok.eos_token_id], [5]],
                                                                          [[ask, tok.eos_token_id]]]))
        rows = loop.start([PROMPT] * 2, [[1, 2]] * 2, {}, [0, 1], ["step 1, row 0", "step 1, row 1"])
        if rule == "stop":
            with pytest.raises(UsageError) as err:
                loop.run(rows, seed=1)
            assert "step 1, row 1: tool call ask({'word': 'hi'}) ask ran past rl.tool_timeout_s 0.2" in str(err.value)
            assert "rl.reward_errors=zero" in str(err.value)
            continue
        loop.run(rows, seed=1)
        assert rows[0].turns[0]["tool_results"] == [str({"error": "Tool nope not found."})] and rows[0].failures == 1
        assert rows[1].finish == "error" and rows[1].failures == 1


def test_an_environment_served_over_http_on_localhost_works_through_the_same_class(tmp_path):
    """OpenEnv's pattern: the class's methods are clients of a server on 127.0.0.1 (here http.server)."""
    import http.server
    import threading

    from harness.rl.multiturn import MultiTurn
    from harness.rl.tools import load_toolbox

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = f"secret of {self.path.strip('/')}".encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env_file = tmp_path / "http_env.py"
    env_file.write_text(
        "import urllib.request\n\n\nclass HttpEnv:\n    def reset(self, **row):\n        self.url = row['url']\n\n"
        "    def reveal(self) -> str:\n        \"\"\"Ask the server.\n\n        Returns:\n            Its answer.\n"
        "        \"\"\"\n        with urllib.request.urlopen(self.url, timeout=5) as r:\n            return r.read().decode()\n")
    try:
        tok = tool_tokenizer()
        rl = {**RL, "tools": [], "environment_factory": f"{env_file}:HttpEnv"}
        reveal, eos = tok.convert_tokens_to_ids(call_text("reveal")), tok.eos_token_id
        loop = MultiTurn(rl, tok, load_toolbox(rl, tmp_path), Scripted([[[reveal, eos], [eos]]]))
        url = f"http://127.0.0.1:{server.server_address[1]}/row7"
        rows = loop.start([PROMPT], [[1, 2]], {"url": [url]}, [0], ["row 0"])
        loop.run(rows, seed=1)
    finally:
        server.shutdown()
    assert rows[0].turns[0]["tool_results"] == ["secret of row7"] and rows[0].finish == "eos"


def test_get_reward_is_a_reward_named_after_the_class_and_rewards_get_environments(tmp_path):
    from harness.rl.rewards import load_rewards
    from harness.rl.tools import load_toolbox

    rewards_file = tmp_path / "r.py"
    rewards_file.write_text("def seen(prompts, completions, environments, **kw):\n"
                            "    return [float(e.revealed) + len(c) for e, c in zip(environments, completions)]\n")
    tok = tool_tokenizer()
    reveal, eos = tok.convert_tokens_to_ids(call_text("reveal")), tok.eos_token_id
    _, rows, _ = _loop([[[reveal, eos], [eos]], [[eos]]])
    rs = load_rewards({"rewards": [f"{rewards_file}:seen"]}, tokenizer=tok, base_dir=tmp_path,
                      environment_rewards=_loop.box.reward_functions())
    box = load_toolbox({"environment_factory": {"secret": f"{ENV_FILE}:SecretEnv"}}, Path.cwd())
    scores = rs.score(prompts=[PROMPT] * 2, completions=[r.replies for r in rows], completion_ids=[[1], [1]],
                      columns={"environments": [r.environment for r in rows]})
    assert rs.names == ("seen", "SecretEnv") and scores == [[1.0 + 3, 1.0], [0.0 + 1, 0.0]]
    with pytest.raises(UsageError) as err:
        box.env_name({"environment": ["other"]}, 0, "record 3")
    assert "record 3: environment 'other' is not one of rl.environment_factory's ['secret']" in str(err.value)


@pytest.mark.parametrize("template,message", [
    ("qwen3", "the chat template is not prefix-preserving"),
    ("llama3_1", "the template's tool calls are not Hermes-style <tool_call> JSON blocks")])
def test_a_template_that_breaks_token_in_token_out_is_refused_before_launch(template, message):
    from helpers.chat_templates import template_tokenizer

    from harness.rl import chat_turns

    problems = chat_turns.problems(template_tokenizer(template), {})
    assert len(problems) == 1 and message in problems[0].message and problems[0].fix
    assert chat_turns.problems(template_tokenizer("qwen3_training"), {}) == []  # a training template passes


def test_bad_tools_and_environments_are_refused_with_the_fix(tmp_path):
    from harness.rl.prompts import encode
    from harness.rl.tools import load_toolbox

    bad = tmp_path / "bad.py"
    bad.write_text("def nodoc(x: int) -> int:\n    return x\n\nclass NoReset:\n    def act(self) -> str:\n"
                   "        \"\"\"Act.\"\"\"\n        return 'a'\n")
    cases = [({"tools": [f"{bad}:nodoc"]}, "rl.tools[0]: nodoc has no tool schema"),
             ({"tools": [f"{bad}:missing"]}, "has no tool 'missing'"),
             ({"environment_factory": f"{bad}:NoReset"}, "has no reset method")]
    for rl, message in cases:
        with pytest.raises(UsageError) as err:
            load_toolbox(rl, tmp_path)
        assert message in str(err.value) and "fix:" in str(err.value), str(err.value)
    with pytest.raises(UsageError) as err:
        encode(tool_tokenizer(), "a text prompt", "data.jsonl: record 1", "prompt", tools=[_schema("reveal")])
    assert "need a conversation" in str(err.value)


def test_a_replay_line_with_a_bad_tool_mask_is_refused_naming_the_line(tmp_path):
    from harness.rl import replay

    good = tool_records()[0]
    path = write_replay(tmp_path / "r.jsonl", 1, rows=[good, {**good, "tool_mask": good["tool_mask"][:-1]}])
    with pytest.raises(UsageError) as err:
        replay.read(path, (0,))
    assert f"rl.replay {path}:2: tool_mask is not one 0 or 1 per completion token (8)" in str(err.value)
    assert len(replay.read(write_replay(tmp_path / "ok.jsonl", 1, rows=tool_records()), (0,))[1]) == 12


def test_a_run_with_a_history_rewriting_template_exits_2_before_any_rank_trains(tmp_path):
    """The launch path (harness/train/checks.py tool_problems): Qwen3's template drops earlier <think> blocks."""
    import os
    import subprocess

    from helpers.chat_templates import template_tokenizer
    from helpers.launch import ROOT

    model = Path(tool_model_folder(tmp_path / "model"))
    tok = template_tokenizer("qwen3")
    tok.add_tokens([call_text(n) for n in ("reveal", "broken")])
    tok.save_pretrained(model)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    argv = ["--recipe", "zero2", "--output-dir", str(tmp_path / "run"), "--set", f"train.model={model}",
            "--set", f"train.dataset={write_prompts(tmp_path / 'p.jsonl', 8)}", "--set", "train.objective=grpo",
            "--set", "rl.num_generations=4", "--set", "batch.micro_batch_per_gpu=4",
            "--set", f"rl.environment_factory={ENV_FILE}:SecretEnv"]
    proc = subprocess.run([sys.executable, "harness/run.py", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rl.tools: the chat template is not prefix-preserving" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


# --- one 2-rank launch ---
MICRO, GAS, WORLD, LR = 3, 2, 2, 1.0
PARITY = [Case("tools_zero2_dapo", "zero2"),
          Case("tools_zero3_grpo_kl_t07", "zero3", {"loss_type": "grpo", "beta": 0.04, "temperature": 0.7},
               reference="ref"),
          Case("tools_zero1_bnpo_masked_old", "zero1", {"loss_type": "bnpo", "mask_truncated_completions": True},
               old_shift=0.3)]
LIVE = {"train.objective": "grpo", "precision": "fp32", "batch.micro_batch_per_gpu": 8, "batch.grad_accum_steps": 1,
        "batch.train_batch_size": '"auto"', "optimizer.type": "adamw", "optimizer.lr": 2e-3, "scheduler.type": "none",
        "optimizer.weight_decay": 0, "gradient_clipping": 1.0, "rl.num_generations": 4,
        "rl.max_completion_length": 160, "rl.max_prompt_length": 1024, "train.log_every": 1, "train.save_every": 0,
        "rl.environment_factory": json.dumps({"secret": f"{ENV_FILE}:SecretEnv", "wall": f"{ENV_FILE}:WallEnv"}),
        "rl.max_tool_calling_iterations": 3}
SHORT = {"train.steps": 4, "rl.num_iterations": 2}  # two generations; the resume stops inside the first
# the toy task's learning run (one plain process): SecretEnv alone, one round of calls, 48 tokens
LEARN = {**LIVE, "batch.micro_batch_per_gpu": 32, "rl.num_generations": 8, "rl.max_completion_length": 48,
         "rl.max_tool_calling_iterations": 1, "rl.environment_factory": f"{ENV_FILE}:SecretEnv", "optimizer.lr": 5e-3,
         "train.steps": 12, "train.seed": 1}
# the head samples the calls more often than tool_model_folder's default: rows take more turns, unevenly per rank
BUSY = {call_text("reveal"): 4.5, call_text("broken"): 3.0, "<|im_end|>": 5.0}


def _argv(out: Path, recipe: str, sets: dict) -> list[str]:
    args = ["--recipe", recipe, "--output-dir", str(out), "--profile-steps", ""]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


def _parity_argv(root: Path, model: str, ref: str, case: Case, replay: Path) -> list[str]:
    sets = {"precision": "fp32", "train.steps": 2, "train.log_every": 1, "scheduler.type": "none",
            "optimizer.type": "sgd", "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 1e9,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": GAS, "batch.train_batch_size": '"auto"',
            "train.model": model, "train.objective": "grpo", "rl.replay": replay, "rl.num_generations": 4,
            "rl.max_completion_length": 12, **{f"rl.{k}": json.dumps(v) for k, v in case.rl.items()}}
    if case.reference:
        sets["rl.reference"] = ref
    return _argv(root / case.name, case.recipe, sets)


def _old(model: str, case: Case):
    if not case.old_shift:
        return None
    return perturbed_old(model, case.old_shift, case.rl.get("temperature", 1.0), rows=tool_records())


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import time

    root = tmp_path_factory.mktemp("rl_tools")
    model, tools_model = llama_folder(root / "llama"), tool_model_folder(root / "tool_llama", logit_boost=BUSY)
    ref = perturbed_folder(model, root / "llama_ref")
    # the second rank's prompts go to WallEnv, whose tool results overflow the budget: its rows end at their first
    # turn while the first rank's go on (ZeRO-3's generate is collective: the second rank must keep joining)
    prompts = write_prompts(root / "prompts.jsonl", 32, walled=second_rank_records(32, 1234, 2, 4))
    argvs = [_parity_argv(root, model, ref, c, write_replay(root / f"{c.name}.jsonl", 2, rows=_with_old(
        tool_records(), _old(model, c)))) for c in PARITY]
    live = {**LIVE, "train.model": tools_model, "train.dataset": prompts}
    argvs += [_argv(root / "live", "zero3", {**live, **SHORT}),
              _argv(root / "stopped", "zero3", {**live, **SHORT, "train.steps": 1}),
              _argv(root / "stopped", "zero3", {**live, **SHORT}) + ["--resume", str(root / "stopped/checkpoints/"
                                                                                     "global_step1")],
              _argv(root / "replayed", "zero3", {**live, **SHORT, "rl.replay": root / "live" / "rollouts.jsonl"})]
    start = time.perf_counter()
    proc = launch_jobs(argvs, root, ranks=WORLD, timeout_s=1200)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    learn = {**LEARN, "train.model": tool_model_folder(root / "learn_llama"),
             "train.dataset": write_prompts(root / "learn.jsonl", 64)}
    launch_jobs([_argv(root / "one", "zero3", {**live, **SHORT, "batch.grad_accum_steps": 2}),
                 _argv(root / "learn", "zero2", learn)], root, ranks=1, launcher=False, timeout_s=600)
    print(f"2-rank launch {seconds:.1f}s, the 1-rank runs (one, learn) {time.perf_counter() - start:.1f}s")
    return root, model, ref, proc, seconds


def _with_old(rows: list[dict], old) -> list[dict]:
    if old is not None:
        for r, o in zip(rows, old):
            r["old_logps"] = o
    return rows


CLIP = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
        "clip_ratio/high_max")


@pytest.mark.multirank
def test_the_step_equals_plain_torch_grpo_with_tool_tokens_masked_and_not_unmasked(launched):
    root, model, ref, _, seconds = launched
    worst = {}
    for case in PARITY:
        old = _old(model, case)
        rl = {"num_generations": 4, "max_completion_length": 12, **case.rl}
        split = rl.get("loss_type", "dapo") in ("dapo", "grpo")  # unchanged by the split: one micro-batch
        micro, gas, world = (MICRO * GAS * WORLD, 1, 1) if split else (MICRO, GAS, WORLD)
        reference = ref if case.reference else None
        want = expected(model, _with_old(tool_records(), old), rl, micro, gas, world, LR, 2, reference,
                        metric_split=(MICRO, GAS, WORLD))
        bare = expected(model, _with_old(tool_records(unmasked=True), old), rl, micro, gas, world, LR, 1, reference)
        got = metric_records(root / case.name, "train")
        errs = []
        for s in range(2):
            tol = 1e-6 if s == 0 else 1e-5
            errs += [close(f"{case.name} step{s + 1}.{k}", got[s][k], want[s][k], tol) for k in ("loss", "grad_norm")]
            errs += [close(f"{case.name} step{s + 1}.{k}", got[s][k], want[s][k], 1e-6) for k in CLIP if k in want[s]]
        apart = abs(bare[0]["grad_norm"] - got[0]["grad_norm"])
        assert apart > 1e-3, (case.name, bare[0], got[0])  # the tool tokens would move the update
        worst[case.name] = (max(errs), apart)
        assert got[0]["completions/mean_length"] == statistics.mean(sum(r["tool_mask"]) for r in tool_records())
        if case.old_shift:
            assert got[0]["clip_ratio/region_mean"] > 0
        if rl.get("beta"):
            assert got[1]["kl"] > 0
    print(f"launch {seconds:.1f}s; per case (worst |error| masked, grad-norm gap to unmasked): {worst}")


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.multirank
def test_zero3_with_uneven_turns_per_rank_finishes_and_equals_one_rank(launched):
    root = launched[0]
    live, one = _lines(root / "live"), _lines(root / "one")
    turns = [[len(r["turns"]) for r in live if r["step"] == s] for s in (1, 3)]
    per_rank = [(max(t[:8]), max(t[8:])) for t in turns]
    print(f"turns per row (steps 1, 3): {turns}; most per rank: {per_rank}")
    # the second rank's rows end at their first turn while the first rank's go on
    assert all(b == 1 for _, b in per_rank) and any(a > 1 for a, _ in per_rank), per_rank
    keys = ("step", "group", "prompt_ids", "completion_ids", "tool_mask", "finish", "rewards", "turns", "tool_calls")
    assert [[r[k] for k in keys] for r in live] == [[r[k] for k in keys] for r in one]
    logp = max(abs(a - b) for x, y in zip(live, one) for a, b in zip(x["sampling_logps"], y["sampling_logps"]))
    got, want = metric_records(root / "live", "train"), metric_records(root / "one", "train")
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(got, want)]
    norms = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want)]
    print(f"2 ranks vs 1: rollouts equal; sampling_logps |diff| {logp:.2g}; loss |diff| {diffs}; grad norm {norms}")
    assert len(got) == 4 and max(diffs) <= 1e-6 and max(norms) <= 1e-5 and logp <= 1e-5
    for r in live:
        assert len(r["tool_mask"]) == len(r["completion_ids"]) == len(r["sampling_logps"])
        assert r["finish"] in ("eos", "length", "budget", "max_iterations")
        assert (r["finish"] == "budget") == any(t.get("rolled_back") for t in r["turns"])
        assert sum(len(t["ids"]) for t in r["turns"]) == sum(r["tool_mask"])
    assert {r["finish"] for r in live} >= {"eos", "budget"} and any(r["tool_calls"] for r in live)


@pytest.mark.multirank
def test_resumed_and_replayed_multi_turn_runs_equal_the_uninterrupted_one(launched):
    root = launched[0]
    live = [r["loss"] for r in metric_records(root / "live", "train")]
    assert [r["loss"] for r in metric_records(root / "stopped", "train")] == live
    assert (root / "stopped" / "rollouts.jsonl").read_text() == (root / "live" / "rollouts.jsonl").read_text()
    assert [r["loss"] for r in metric_records(root / "replayed", "train")] == live


def learned(steps: list[dict]) -> tuple[float, float, float]:
    """The mean reward of the first 2 steps and of the last 4, and the last 4 steps' mean tools/call_frequency."""
    late = steps[-4:]
    return (statistics.mean(r["reward"] for r in steps[:2]), statistics.mean(r["reward"] for r in late),
            statistics.mean(r["tools/call_frequency"] for r in late))


@pytest.mark.multirank
def test_reward_and_tool_calls_rise_on_the_toy_task(launched):
    steps = metric_records(launched[0] / "learn", "train")
    early, late, calls = learned(steps)
    print(f"reward per step {[round(r['reward'], 2) for r in steps]}; calls per rollout "
          f"{[round(r['tools/call_frequency'], 2) for r in steps]}; {sum(r['step_time_s'] for r in steps):.1f}s")
    assert len(steps) == 12 and late >= 0.3 and late >= early + 0.15 and calls >= 0.7, (early, late, calls)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
