"""Knowledge distillation (issue 45), train.objective gkd on the dataset's completions, on real DeepSpeed ranks
against a plain-torch generalised JSD (tests/helpers/distill_ref.py, written from the issue's formulas): a 1-layer
Llama student and a 3-layer, sharpened Llama teacher with one tokenizer, SGD lr 1, no clipping. The first step's loss, grad
norm, entropy and teacher entropy, the SECOND step's loss (which shows the update) and the eval after it within
1e-5, for beta 0, 0.5 and 1 at loss temperatures 1 and 0.9, on ddp, ZeRO-2 and ZeRO-3 (the teacher engine
ZeRO-3-sharded), with accumulation, a CE term and the adapter mode under LoRA; 2 ranks whose rows hold unequal token
counts. All cases run in ONE 2-rank launch, shared with the other distillation tests (tests/helpers/
distill_launch.py); the ZeRO-3 case's export loads with AutoModelForCausalLM and gives the
plain-torch student's logits. The refusals run without ranks (the teacher's checks in one plain process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cli import main
from helpers.distill_launch import CASES, LR, MICRO, ON_POLICY_STEPS, STEPS, argv, on_policy_argv
from helpers.distill_ref import Case, expected
from helpers.launch import launch_jobs, records, run_checked
from helpers.models import llama_folder

RTOL, ATOL = 1e-5, 1e-6  # fp32 logits and float32 chunks against float64: measured at most 1.3e-7 relative


@pytest.fixture(scope="module")
def launched(distill_runs):
    """(the gkd cases' root, the shared launch: conftest's distill_runs)."""
    return distill_runs.root / "gkd", distill_runs


def _split(root: Path, case: Case):
    from types import SimpleNamespace

    from harness.config.recipes import load_recipe
    from harness.model.hf import load_tokenizer
    from harness.train.distill_data import load_completions

    args = argv(root, case)
    recipe = load_recipe(case.recipe, [args[i + 1] for i, a in enumerate(args) if a == "--set"])[0]
    train, evals, _ = load_completions(SimpleNamespace(recipe=recipe), load_tokenizer(str(root / "student")))
    return recipe, train, evals


def _close(name: str, got, want) -> float:
    assert got is not None, f"{name} not logged (want {want})"
    assert abs(got - want) <= RTOL * abs(want) + ATOL, f"{name}: {got} vs {want}"
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.mark.multirank
def test_every_beta_temperature_and_layout_matches_plain_torch(launched):
    root, runs = launched
    worst = {}
    for case in CASES:
        recipe, train, evals = _split(root, case)
        want = expected(case, recipe, str(root / "student"), str(root / "teacher"), train, evals, STEPS, LR)
        got = records(root / case.name, "train")
        assert len(got) == STEPS and got[1]["loss"] != got[0]["loss"], got
        errs = []
        for step, (g, w) in enumerate(zip(got, want["train"])):
            keys = ("loss", "entropy", "teacher_entropy") + (("grad_norm",) if g["grad_norm"] is not None else ())
            errs += [_close(f"{case.name} step{step + 1}.{k}", g[k], w[k]) for k in keys]
        assert case.recipe == "ddp" or got[0]["grad_norm"] is not None
        [evaluated] = records(root / case.name, "eval")
        errs += [_close(f"{case.name} {k}", evaluated[k], v) for k, v in want["eval"].items()]
        worst[case.name] = f"loss {got[0]['loss']:.3g}, error {max(errs):.2g}"
        tokens = [w["tokens"] for w in want["train"]]
        assert len(set(tokens)) > 1 or case.gas > 1, tokens  # steps (and ranks) see unequal token counts
    print(f"shared launch {runs.seconds:.1f}s; first loss and worst relative error per case: {worst}")


@pytest.mark.multirank
def test_the_teacher_mode_is_named_with_its_cost(launched):
    root, runs = launched
    out = runs.out
    assert "teacher: engine of" in out("zero3_reverse_kl_t09") and "ZeRO-3 sharded" in out("zero3_reverse_kl_t09")
    assert "a whole copy" in out("zero2_jsd_t09_ga2_ce") and "(auto: a teacher model is named)" in out("ddp_forward_kl")
    assert "teacher: adapter" in out("zero2_lora_adapter_jsd_ce") and "auto: LoRA and no teacher named" in \
        out("zero2_lora_adapter_jsd_ce")
    record = records(root / "zero2_jsd_t09_ga2_ce", "train")[0]
    assert record["num_tokens"] > 0 and record["time/teacher_s"] > 0 and record["time/train_s"] > 0


@pytest.mark.multirank
def test_the_zero3_export_loads_and_gives_the_trained_students_logits(launched, tmp_path):
    from transformers import AutoModelForCausalLM

    from helpers.export_checks import assert_export_equals_engine

    root, _ = launched
    case = CASES[3]
    run = root / case.name
    assert_export_equals_engine(run / "checkpoints" / f"global_step{STEPS}", tmp_path / "export")
    recipe, train, evals = _split(root, case)
    want = expected(case, recipe, str(root / "student"), str(root / "teacher"), train, evals, STEPS, LR)["model"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", torch_dtype=torch.float32).eval()
    input_ids = train[torch.arange(4)].tensors()[0]
    with torch.no_grad():
        got, ref = exported(input_ids=input_ids).logits, want.eval()(input_ids=input_ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (got - ref).abs().max()


@pytest.mark.multirank
def test_on_policy_learns_from_the_teacher_and_resumes_to_the_same_completions_and_losses(launched):
    root, _ = launched
    full, resumed = records(root / "on_policy", "train"), records(root / "on_policy_resumed", "train")
    assert [r["step"] for r in full] == list(range(1, ON_POLICY_STEPS + 1)) and [r["step"] for r in resumed] == [4, 5, 6]
    assert all(r["completions/on_policy"] == 2 * MICRO * 2 for r in full)  # lmbda 1: every row the student's own
    keys = ("loss", "completions/mean_length", "num_tokens", "teacher_entropy")
    assert [[r[k] for k in keys] for r in full[3:]] == [[r[k] for k in keys] for r in resumed]
    losses = [r["loss"] for r in full]
    assert losses[-1] < 0.8 * losses[0], losses  # the student's divergence to the teacher on its own samples falls
    print(f"on-policy losses {[round(x, 4) for x in losses]}")


def _rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.multirank
def test_on_policy_completions_are_recorded_and_a_resume_continues_the_file(launched):
    """RUN/rollouts.jsonl (harness/rl/rollouts.py) holds every generated completion of the run, in row order, the
    metrics' counts and lengths; the resumed run (whose folder held an earlier attempt's lines for steps 1-6) keeps
    steps 1-3 and writes steps 4-6 once, equal to the uninterrupted run's."""
    from harness.model.hf import load_tokenizer

    root, _ = launched
    full, steps = _rollouts(root / "on_policy"), records(root / "on_policy", "train")
    per_step = 2 * MICRO * 2  # lmbda 1: every row of 2 ranks x 2 micro x 2 accumulation
    assert [r["step"] for r in full] == [s for s in range(1, ON_POLICY_STEPS + 1) for _ in range(per_step)]
    assert [r["row"] for r in full] == list(range(per_step)) * ON_POLICY_STEPS
    tok = load_tokenizer(str(root / "student"))
    data = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    for record in steps:
        mine = [r for r in full if r["step"] == record["step"]]
        assert len(mine) == record["completions/on_policy"] and all(r["source"] == "student" for r in mine)
        lengths = [len(r["completion_ids"]) for r in mine]
        assert sum(lengths) / len(lengths) == pytest.approx(record["completions/mean_length"], rel=1e-12)
        assert all(0 < n <= 8 for n in lengths)  # distill.max_new_tokens 8
    for r in full:
        assert r["prompt_ids"] == tok(data[r["prompt_index"]]["prompt"])["input_ids"], r
        assert r["finish"] == ("eos" if tok.eos_token_id in r["completion_ids"] else "length"), r
    resumed = _rollouts(root / "on_policy_resumed")
    assert resumed[:3] == [{"step": s, "stale": True} for s in (1, 2, 3)]  # the lines before the resumed step
    assert resumed[3:] == [r for r in full if r["step"] > 3]  # steps 4-6 once, as the uninterrupted run drew them


@pytest.mark.multirank
def test_seq_kd_the_teacher_generates_the_other_rows_on_zero3(launched):
    """seq_kd on ZeRO-3: each row's completion is the student's (lmbda 0.5) or the sharded teacher engine's, drawn
    from the row's own stream; step 1's completions equal HF generate of the plain student and teacher with the
    same streams (the harness's HFGenerator on each model in one process)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from harness.config.recipes import load_recipe
    from harness.model.hf import load_tokenizer
    from harness.rl.generation.hf import HFGenerator
    from harness.train.distill_policy import SEED_STRIDE
    from helpers.distill_launch import seq_kd_argv

    root, runs = launched
    steps, made = records(root / "seq_kd", "train"), _rollouts(root / "seq_kd")
    assert "teacher: engine of" in runs.out("seq_kd") and "ZeRO-3 sharded" in runs.out("seq_kd")
    assert [r["completions/on_policy"] + r["completions/teacher"] for r in steps] == [2 * MICRO] * 2
    assert {r["source"] for r in made} == {"student", "teacher"} and len(made) == 2 * 2 * MICRO
    for record in steps:
        theirs = [len(r["completion_ids"]) for r in made if r["step"] == record["step"] and r["source"] == "teacher"]
        assert len(theirs) == record["completions/teacher"] and record["loss"] > 0
        assert sum(theirs) / max(len(theirs), 1) == pytest.approx(record["completions/teacher_mean_length"])
    args = seq_kd_argv(root)
    recipe = load_recipe("zero3", [args[i + 1] for i, a in enumerate(args) if a == "--set"])[0]
    seed = recipe["train"]["seed"] * SEED_STRIDE + 0  # step 1 generates with the weights of step 0
    tok = load_tokenizer(str(root / "student"))
    rl = {"generator": "hf", "max_completion_length": 6, "temperature": 0.9, "top_k": 0, "top_p": 1.0}
    for source in ("student", "teacher"):
        model = AutoModelForCausalLM.from_pretrained(root / source, torch_dtype=torch.float32).eval()
        generator = HFGenerator(rl, SimpleNamespace(module=model), tok, bound_bytes=None)
        for r in (r for r in made if r["step"] == 1 and r["source"] == source):
            assert generator.generate([r["prompt_ids"]], seed=seed, first_row=r["row"])[0] == r["completion_ids"], r


@pytest.mark.multirank
def test_objective_distill_trains_on_the_students_completions_of_prompts(launched):
    root, runs = launched
    assert "prompts (the student generates every completion)" in runs.out("distill_prompts")
    steps = records(root / "distill_prompts", "train")
    assert [r["completions/on_policy"] for r in steps] == [2 * MICRO] * 2  # every row of the step, both ranks
    assert all(0 < r["completions/mean_length"] <= 6 and r["loss"] > 0 for r in steps)
    assert records(root / "distill_prompts", "eval")[0]["eval_loss"] > 0  # on the student's completions too


@pytest.mark.multirank
def test_on_policy_completions_do_not_depend_on_the_world_size(launched):
    """One process with twice the accumulation: the same rows per step, each drawing from its own stream."""
    root, _ = launched
    launch_jobs([on_policy_argv(root, "on_policy_one_rank", gas=4, steps=3)], root, ranks=1, launcher=False,
                timeout_s=600)
    two, one = records(root / "on_policy", "train")[:3], records(root / "on_policy_one_rank", "train")
    keys = ("completions/mean_length", "num_tokens")
    assert [[r[k] for k in keys] for r in one] == [[r[k] for k in keys] for r in two]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]) for a, b in zip(one, two)), (one, two)


def _validate(tmp_path, recipe: dict, capsys, world: int = 2) -> str:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert main(["validate", str(path), "--world-size", str(world)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("objective,block,message", [
    ("gkd", {"lmbda": 0, "beta": 1.5}, "distill.beta: beta 1.5 is outside [0, 1]"),
    ("gkd", {"lmbda": -0.1}, "distill.lmbda: lmbda -0.1 is outside [0, 1]"),
    ("gkd", {"lmbda": 0, "seq_kd": True, "teacher_model_server_url": "http://127.0.0.1:9"},
     "distill.seq_kd: seq_kd true with teacher_mode served: the teacher would generate"),
    ("distill", {"seq_kd": True}, "distill.seq_kd: seq_kd true with objective distill: TRL's DistillationConfig"),
    ("distill", {"lmbda": 0}, "distill.lmbda: lmbda 0 with objective distill: TRL's DistillationConfig has no lmbda"),
    ("gkd", {"lmbda": 0, "teacher_mode": "adapter"}, "teacher_mode adapter without LoRA"),
    ("gkd", {"lmbda": 0.5, "teacher_mode": "precomputed"}, "teacher_mode precomputed with on-policy completions")])
def test_bad_settings_are_refused_before_launch(tmp_path, capsys, objective, block, message):
    err = _validate(tmp_path, {"description": "kd", "train": {"objective": objective}, "distill": block}, capsys)
    assert message in err and "fix:" in err


@pytest.mark.parametrize("parallel,key", [({"pipeline": 2}, "parallel.pipeline"), ({"tensor": 2}, "parallel.tensor"),
                                          ({"sequence": 2}, "parallel.sequence")])
def test_pipeline_tensor_and_sequence_parallel_are_refused_with_the_reason(tmp_path, capsys, parallel, key):
    recipe = {"description": "kd", "parallel": parallel, "train": {"objective": "gkd"}, "distill": {"lmbda": 0}}
    err = _validate(tmp_path, recipe, capsys, world=4)
    assert f"{key}: {key.split('.')[1]} 2 with objective gkd is not implemented" in err and "fix:" in err


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused_before_any_rank(tmp_path):
    import sys

    from harness.model.hf import load_tokenizer

    student = llama_folder(tmp_path / "student", layers=1)
    wide = Path(llama_folder(tmp_path / "wide"))
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 640}))
    other = Path(llama_folder(tmp_path / "other"))
    tokenizer = load_tokenizer(str(other))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    tokenizer.save_pretrained(other)
    for teacher, message in ((wide, "vocab_size 640 of the teacher"), (other, "the teacher's tokenizer (")):
        proc = run_checked([sys.executable, "harness/run.py", "--recipe", "ddp", "--output-dir", str(tmp_path / "run"),
                            "--set", "train.objective=gkd", "--set", "distill.lmbda=0", "--set",
                            f"train.model={student}", "--set", f"distill.teacher_model_name_or_path={teacher}"],
                           timeout_s=300, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"distill.teacher_model_name_or_path: {message}" in proc.stderr and "fix:" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_records_are_tokenized_as_trl_does(tmp_path):
    """Prompt ids, then tokenizer(prompt + completion) past them with the eos text appended; labels on the
    completion only; a long completion cut at seq_len."""
    from harness.model.hf import load_tokenizer
    from harness.train.distill_data import encode_records

    tok = load_tokenizer("tiny-llama")
    records = [{"prompt": "Question: What color is the sky?\nAnswer:", "completion": " The sky is blue."},
               {"prompt": "Hi", "completion": " a b c d e f g h i j k l m n o p q r s t u v w x y z" * 2}]
    rows, counts = encode_records(records, "t", tok, 40)
    ids, labels, _ = rows.tensors()
    p = tok(records[0]["prompt"])["input_ids"]
    pc = tok(records[0]["prompt"] + records[0]["completion"] + tok.eos_token)["input_ids"]
    assert ids[0, :len(pc)].tolist() == pc and pc[-1] == tok.eos_token_id
    assert (labels[0, :len(p)] == -100).all() and labels[0, len(p):len(pc)].tolist() == pc[len(p):]
    assert (labels[0, len(pc):] == -100).all() and counts == {"records": 2, "truncated": 1}
    assert (labels[1] != -100).sum() == 40 - len(tok("Hi")["input_ids"])


def test_the_ce_term_skips_the_students_own_completions():
    """A row whose completion the student generated carries the divergence but no CE (ce_labels -1 there)."""
    from harness.train.distill import ce_labels
    from harness.train.distill_loss import Targets, full_vocabulary

    torch.manual_seed(0)
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, 8, 9, 1]])
    where = labels[:, 1:] != -100
    # the batch: input_ids, labels, prompt lengths, record numbers, the rows the student completed
    mine = ce_labels((labels, labels, torch.tensor([2, 1]), torch.tensor([0, 1]), torch.tensor([False, True])), where)
    assert mine.tolist() == [5, 6, -1, -1, -1, -1]
    s, t = torch.randn(6, 11), torch.randn(6, 11)
    cfg = {"beta": 0.5, "loss_temperature": 1.0, "ce_alpha": 0.3, "loss_chunk_tokens": 4}
    with_ce, without = full_vocabulary(s, Targets(logits=t), labels[:, 1:][where], cfg)[0], \
        full_vocabulary(s, Targets(logits=t), mine, cfg)[0]
    skipped = -torch.log_softmax(s[2:], -1).gather(-1, torch.tensor([[7], [8], [9], [1]])).sum()
    assert torch.allclose(with_ce - without, 0.3 * skipped)


def test_use_vllm_is_refused_before_launch_without_cuda():
    """distill.use_vllm (TRL's key): the student's completions from a colocated vLLM, GPU only (bench/gpu_check.sh's
    distill case runs it there); here it is refused with the reason before any rank starts."""
    from harness.rl.generation import generator_problems

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    problems = generator_problems({"train": {"objective": "gkd"}, "distill": {"use_vllm": True, "lmbda": 1}})
    assert [p.path for p in problems] == ["distill.use_vllm"]
    assert "distill.use_vllm needs CUDA GPUs; this machine has none" in problems[0].message
    assert "distill.use_vllm=false" in problems[0].fix
    assert generator_problems({"train": {"objective": "distill"}, "distill": {"use_vllm": False}}) == []
