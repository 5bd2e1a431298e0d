"""rl.rewards: TRL-signature functions from files and modules, with weights and every dataset column; bad entries
refused with the fix; a raising function named with its sample (stop) or scored 0 (zero); the built-ins (exact
match, regex, math-verify, code in the sandbox); the HTTP verifier against servers this test opens on 127.0.0.1
(slow, failing, timing out, refusing, bounded concurrency)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.errors import UsageError
from harness.rl.rewards import RewardError, load_rewards

TRL_FILE = '''
def accuracy(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def length_bonus(completions, completion_ids=None, **kwargs):
    return [None if not ids else len(ids) / 10 for ids in completion_ids]

def picky(prompts, completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot score boom")
    return [0.5 for _ in completions]

def no_kwargs(prompts, completions):
    return [1.0] * len(completions)

def wrong(text):
    return [1.0]
'''
BATCH = dict(prompts=["2+2=", "3+3=", "say boom"], completions=["4", " 7", "boom"],
             completion_ids=[[10, 2], [11, 12, 2], []], columns={"answer": ["4", "6", None]})


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "my_rewards.py").write_text(TRL_FILE)
    return tmp_path


def load(folder, rewards, **rl):
    return load_rewards({"rewards": rewards, **rl}, tokenizer=None, base_dir=folder)


def test_trl_reward_files_run_unchanged_with_weights_and_columns(folder):
    rs = load(folder, ["my_rewards.py:accuracy", {"function": "my_rewards:length_bonus", "weight": 0.5},
                       {"function": "my_rewards.py:no_kwargs", "name": "always"}])
    assert rs.names == ("accuracy", "length_bonus", "always") and rs.weights == (1.0, 0.5, 1.0)
    got = rs.score(**BATCH)
    assert got == [[1.0, 0.2, 1.0], [0.0, 0.3, 1.0], [0.0, None, 1.0]]


@pytest.mark.parametrize("entry, words", [
    ("nofile.py:accuracy", ["rl.rewards[0]", "no such file", "fix:"]),
    ("my_rewards.py:missing", ["has no function 'missing'", "accuracy, length_bonus"]),
    ("no_such_module:fn", ["module 'no_such_module' does not import", "fix:"]),
    ("my_rewards.py:wrong", ["takes no prompts, completions", "def reward(prompts, completions"]),
    ("just_a_name", ["is not module:function"]),
    ({"function": "my_rewards.py:accuracy", "builtin": "math"}, ["names function and builtin", "exactly one"]),
    ({"builtin": "sql"}, ["no built-in reward 'sql'", "exact_match, regex, math, code"]),
])
def test_a_bad_entry_is_refused_with_the_fix(folder, entry, words):
    with pytest.raises(UsageError) as err:
        load(folder, [entry])
    for word in words:
        assert word in str(err.value), str(err.value)


def test_a_file_that_does_not_import_is_named(folder):
    (folder / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(UsageError, match=r"broken.py does not import: ModuleNotFoundError"):
        load(folder, ["broken.py:fn"])


def test_a_raising_function_is_named_with_its_sample_or_scored_zero(folder):
    with pytest.raises(RewardError) as err:
        load(folder, ["my_rewards.py:picky"]).score(**BATCH)
    text = str(err.value)
    assert "rl.rewards[0] (picky) raised ValueError: cannot score boom on sample 2" in text
    assert "'say boom'" in text and "rl.reward_errors=zero" in text
    rs = load(folder, ["my_rewards.py:picky"], reward_errors="zero")
    assert rs.score(**BATCH) == [[0.5], [0.5], [0.0]] and rs.errors == {"picky": 1}


def test_a_wrong_return_is_an_error_of_the_function(folder):
    (folder / "bad_return.py").write_text("def f(prompts, completions, **k):\n    return [1.0]\n")
    with pytest.raises(RewardError, match=r"returned list of 1 items for 1 completions|returned list of 1 items"):
        load(folder, ["bad_return.py:f"]).score(prompts=["a", "b"], completions=["x", "y"], completion_ids=None,
                                               columns={})


def test_builtins(folder):
    rs = load(folder, [{"builtin": "exact_match"}, {"builtin": "regex", "pattern": r"^\s*\d+$"},
                       {"builtin": "math"}])
    got = rs.score(prompts=["a", "b", "c", "d"], completions=["4", "The answer is $\\frac{1}{2}$", "x", "0.5"],
                   completion_ids=None, columns={"answer": ["4", "0.5", None, "\\boxed{\\frac{1}{2}}"]})
    assert got == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [None, 0.0, None], [0.0, 0.0, 1.0]]


def test_code_runs_in_the_sandbox(folder):
    rs = load(folder, [{"builtin": "code"}], sandbox={"cpu_s": 2, "timeout_s": 8, "memory_mb": 256})
    ok = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    escape = "```python\nopen('/tmp/code_reward_escape', 'w').write('x')\ndef add(a, b):\n    return a + b\n```"
    got = rs.score(prompts=["p"] * 4, completions=[ok, wrong, escape, ok], completion_ids=None,
                   columns={"tests": ["assert add(2, 3) == 5"] * 3 + [None]})
    assert got == [[1.0], [0.0], [0.0], [None]]


class Verifier(BaseHTTPRequestHandler):
    """POST /ok: 1.0 per completion; /slow: after `delay` s; /flaky: 500 for the first `fails` requests;
    /bad: 400; /garbage: not the rewards. Counts requests and the most in flight at once."""

    state = {"requests": 0, "inflight": 0, "max_inflight": 0, "fails": 0, "delay": 0.0}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.state
        with self.lock:
            s["requests"] += 1
            s["inflight"] += 1
            s["max_inflight"] = max(s["max_inflight"], s["inflight"])
        try:
            if self.path == "/slow":
                time.sleep(s["delay"])
            if self.path == "/flaky" and s["fails"] > 0:
                s["fails"] -= 1
                return self._send(500, {"error": "busy"})
            if self.path == "/bad":
                return self._send(400, {"error": "no"})
            if self.path == "/garbage":
                return self._send(200, {"scores": 1})
            self._send(200, {"rewards": [float(len(c)) for c in body["completions"]]})
        finally:
            with self.lock:
                s["inflight"] -= 1

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    Verifier.state.update(requests=0, inflight=0, max_inflight=0, fails=0, delay=0.0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", Verifier.state
    srv.shutdown()
    srv.server_close()


def verify(url, path, n=6, **entry):
    rs = load_rewards({"rewards": [{"verifier": url + path, **entry}], "reward_errors": entry.pop("errors", "stop")},
                      tokenizer=None, base_dir=".")
    return rs, rs.score(prompts=["p"] * n, completions=["x" * i for i in range(n)], completion_ids=None,
                        columns={"answer": list(range(n))})


def test_verifier_batches_with_bounded_concurrency(server):
    url, state = server
    state["delay"] = 0.2
    _, got = verify(url, "/slow", n=12, batch_size=2, concurrency=2, timeout_s=5)
    assert [g[0] for g in got] == [float(i) for i in range(12)]
    assert state["requests"] == 6 and state["max_inflight"] == 2


def test_verifier_retries_a_failing_server(server):
    url, state = server
    state["fails"] = 2
    _, got = verify(url, "/flaky", retries=2)
    assert [g[0] for g in got] == [float(i) for i in range(6)] and state["requests"] == 3
    state["fails"] = 5
    with pytest.raises(RewardError, match=r"gave no rewards after 3 attempt\(s\): HTTP 500"):
        verify(url, "/flaky", retries=2)


def test_verifier_timeout_stops_or_scores_zero(server):
    url, state = server
    state["delay"] = 1.0
    began = time.perf_counter()
    with pytest.raises(RewardError, match=r"after 2 attempt\(s\): (TimeoutError|URLError|timeout)"):
        verify(url, "/slow", timeout_s=0.2, retries=1)
    assert time.perf_counter() - began < 3
    rs, got = verify(url, "/slow", timeout_s=0.2, retries=0, errors="zero")
    assert got == [[0.0]] * 6 and rs.errors == {"verifier": 6}


def test_verifier_4xx_and_garbage_are_not_retried(server):
    url, state = server
    with pytest.raises(RewardError, match="HTTP 400"):
        verify(url, "/bad", retries=3)
    assert state["requests"] == 1
    with pytest.raises(RewardError, match=r"expected \{\"rewards\""):
        verify(url, "/garbage", retries=0)


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A tiny sequence-classification Llama with one label and the shipped tokenizer (what train.objective=reward
    exports), seeded random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    path = tmp_path_factory.mktemp("reward_model")
    eos = _shipped_eos_id()
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=eos,
                         bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return path


def test_a_reward_model_scores_as_transformers_does(reward_folder):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_folder)
    rs = load_rewards({"rewards": [{"model": str(reward_folder), "weight": 0.5}]}, tokenizer=tok, base_dir=".")
    prompts, completions = ["Question: 2+2?\nAnswer:", "Say hi:"] * 10, [" 4.", " hi there", " five"] * 6 + [" x", ""]
    got = [row[0] for row in rs.score(prompts=prompts, completions=completions, completion_ids=None, columns={})]
    model = AutoModelForSequenceClassification.from_pretrained(reward_folder).eval()
    with torch.no_grad():
        want = [model(**tok([p + c], add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
                for p, c in zip(prompts, completions)]
    assert rs.names == ("reward_model",) and rs.weights == (0.5,)
    assert got == pytest.approx(want, abs=1e-5)  # batched with right padding == one at a time


def test_a_reward_model_of_another_tokenizer_is_refused(reward_folder):
    from transformers import GPT2TokenizerFast
    from tokenizers import Tokenizer, models

    other = GPT2TokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2},
                                                                            unk_token="<unk>")))
    with pytest.raises(UsageError, match=r"(?s)rl.rewards\[0\]: reward model .* has another tokenizer .*fix: .*\"own\""):
        load_rewards({"rewards": [{"model": str(reward_folder)}]}, tokenizer=other, base_dir=".")
    rs = load_rewards({"rewards": [{"model": str(reward_folder), "tokenizer": "own"}]}, tokenizer=other, base_dir=".")
    assert rs.names == ("reward_model",)


def test_bradley_terry_loss_and_metrics():
    import torch

    from harness.train.reward import bradley_terry

    scores = torch.tensor([2.0, 0.0, 1.0, 1.0, -1.0, 1.0])  # chosen 2, 0, 1; rejected 1, -1, 1
    loss, metrics = bradley_terry(scores)
    margins = torch.tensor([1.0, 1.0, 0.0])
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(margins).mean().item())
    assert metrics["rewards_accuracy"].item() == pytest.approx(2 / 3)  # a tie counts wrong
    assert metrics["rewards_margin"].item() == pytest.approx(2 / 3)
