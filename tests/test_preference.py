"""Preference optimisation (issue 32) on real DeepSpeed ranks against a plain-torch DPO / IPO / SimPO / ORPO
(tests/helpers/preference_ref.py, written from the issue's formulas), with a reference checkpoint that differs from
the policy, SGD lr 1 and no clipping: the first step's loss, every metric, the grad norm, and the SECOND step's loss
(which shows the update) within 1e-5 on ddp, ZeRO-1/2/3, offload, LoRA (adapter mode), GA 2 and each reference
mode, on tiny Llama and Qwen2 folders in fp32. All cases run in ONE 2-rank launch; a resume case after its run
reads the precomputed table from the cache. The layout refusals run without ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from helpers.launch import job_output, launch_jobs, records
from helpers.models import llama_folder, perturbed_folder, qwen2_folder
from helpers.preference_ref import METRICS, Case, expected, write_pairs

STEPS, SEQ_LEN, MICRO, LR, EVAL_FRACTION = 2, 32, 2, 1.0, 0.25
# Relative, with an absolute floor for values near 0: both sides sum fp32 per-token log-probs (each ~1e-7 off) and
# after one update their weights differ by rounding, so a log-prob sum differs by ~1e-6 and a reward (beta x it) by
# ~1e-7: measured 1.5e-7 on a margin of 0.015 (1e-5 relative). The other values stay under 7e-6 relative.
RTOL, ATOL = 1e-5, 1e-6


def common(folder: Path, case: Case, data: Path) -> list[str]:
    sets = {"precision": "fp32", "train.steps": STEPS, "train.seq_len": SEQ_LEN, "train.save_every": 1,
            "train.eval_every": STEPS, "train.log_every": 1, "scheduler.type": "none", "optimizer.type": "sgd",
            "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 0,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": case.gas, "batch.train_batch_size": '"auto"',
            "train.eval_fraction": EVAL_FRACTION, "train.model": case.model, "train.dataset": data,
            "train.store_dir": folder / "stores", "train.objective": case.objective,
            "preference.reference_mode": case.mode,
            "preference.label_smoothing": case.label_smoothing}
    if case.reference:
        sets["preference.reference"] = case.reference
    if case.lora:
        sets.update({"adapter.type": "lora", "adapter.dropout": 0})
    argv = ["--recipe", case.recipe, "--output-dir", str(folder / case.name)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + case.extra


def cases(root: Path) -> list[Case]:
    llama, qwen = llama_folder(root / "llama"), qwen2_folder(root / "qwen2")
    llama_ref, qwen_ref = perturbed_folder(llama, root / "llama_ref"), perturbed_folder(qwen, root / "qwen2_ref")
    return [Case("ddp_dpo_precomputed", "ddp", llama, "dpo", "precomputed", llama_ref, label_smoothing=0.1),
            Case("zero1_ipo_engine", "zero1", llama, "ipo", "engine", llama_ref),  # a stage-0 reference copy
            Case("zero2_dpo_ga2_precomputed", "zero2", qwen, "dpo", "auto", qwen_ref, gas=2),
            Case("zero3_dpo_engine", "zero3", qwen, "dpo", "engine", qwen_ref),  # a ZeRO-3 reference engine
            Case("zero3_ipo_precomputed", "zero3", llama, "ipo", "precomputed", llama_ref),  # a ZeRO-3 pass
            Case("zero1_simpo", "zero1", qwen, "simpo"),
            Case("zero2_offload_orpo", "zero2_offload", llama, "orpo"),
            Case("zero2_lora_dpo_adapter", "zero2", llama, "dpo", "adapter", lora=True),
            Case("zero3_lora_dpo_adapter", "zero3", qwen, "dpo", "auto", lora=True)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import time

    root = tmp_path_factory.mktemp("preference")
    data = write_pairs(root / "pairs.jsonl", count=17)  # odd: a ZeRO-3 pass pads one rank
    all_cases = cases(root)
    argvs = [common(root, c, data) for c in all_cases]
    resume = common(root, all_cases[0], data)
    resume[resume.index("--output-dir") + 1] = str(root / "resumed")
    resume += ["--resume", str(root / all_cases[0].name / "checkpoints" / "global_step1")]
    start = time.perf_counter()
    proc = launch_jobs(argvs + [resume], root, ranks=2, timeout_s=900)
    return root, data, all_cases, proc, time.perf_counter() - start


def _close(name: str, got, want) -> tuple[float, float]:
    """(the logged value's expected magnitude, its absolute error)."""
    assert got is not None, f"{name} not logged (want {want})"
    err = abs(got - want)
    assert err <= RTOL * abs(want) + ATOL, f"{name}: {got} vs {want}"
    return abs(want), err


def _worst(errs: list[tuple[float, float]]) -> str:
    """The largest relative error of the values not near 0, the largest absolute error of those near 0."""
    rel = max((err / size for size, err in errs if size >= 0.01), default=0.0)
    near = max((err for size, err in errs if size < 0.01), default=0.0)
    return f"rel {rel:.2g}, abs {near:.2g} near 0"


def pairs_of(recipe: dict, model: str):
    """(train, eval) Pairs of the store the launch prepared (harness/data/preference.py)."""
    from types import SimpleNamespace

    from harness.data.preference import load_pairs
    from harness.model.hf import load_tokenizer

    train, evals, _ = load_pairs(SimpleNamespace(recipe=recipe), SimpleNamespace(local_rank=0), load_tokenizer(model))
    return train, evals


@pytest.mark.multirank
def test_every_objective_layout_and_mode_matches_plain_torch(launched):
    from harness.config.recipes import load_recipe

    root, data, all_cases, proc, seconds = launched
    worst = {}
    for case in all_cases:
        argv = common(root, case, data)
        recipe = load_recipe(case.recipe, [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])[0]
        train, evals = pairs_of(recipe, case.model)
        want = expected(case, recipe, train, evals, STEPS, LR)
        got = records(root / case.name, "train")
        errs = []
        for step, (g, w) in enumerate(zip(got, want["train"])):
            # DeepSpeed computes no grad norm on ZeRO-0 without clipping (gradient_clipping 0): logged as null
            keys = ("loss", *METRICS) + (("grad_norm",) if case.recipe != "ddp" else ())
            errs += [_close(f"step{step + 1}.{k}", g[k], w[k]) for k in keys]
        [evaluated] = records(root / case.name, "eval")
        errs += [_close(k, evaluated[k], v) for k, v in want["eval"].items()]
        worst[case.name] = _worst(errs)
        assert len(got) == STEPS and got[1]["loss"] != got[0]["loss"]
    print(f"launch {seconds:.1f}s; worst error per case over {len(errs)} values: {worst}")


@pytest.mark.multirank
def test_modes_are_named_and_the_precomputed_table_is_reused_on_resume(launched):
    root, _, all_cases, proc, _ = launched
    names = [c.name for c in all_cases]
    out = lambda name: job_output(proc.stdout, names.index(name))  # noqa: E731
    assert "reference: precomputed from" in out("ddp_dpo_precomputed")
    assert "reference: engine of" in out("zero3_dpo_engine") and "ZeRO-3 sharded" in out("zero3_dpo_engine")
    assert "reference: adapter" in out("zero3_lora_dpo_adapter")  # auto under LoRA with no other reference
    assert "reference: precomputed" in out("zero2_dpo_ga2_precomputed")  # auto otherwise
    assert "reference: none (simpo has no reference model)" in out("zero1_simpo")
    assert "reference: none (orpo" in out("zero2_offload_orpo")
    resumed = job_output(proc.stdout, len(all_cases))
    assert "read from" in resumed and "reference_logps-" in resumed
    first, again = records(root / all_cases[0].name, "train"), records(root / "resumed", "train")
    assert [r["step"] for r in again] == [2] and again[0]["loss"] == first[1]["loss"]
    assert all(not p.name.startswith("reference") for p in (root / all_cases[0].name / "checkpoints").rglob("*"))


@pytest.mark.multirank
def test_report_plots_margin_and_accuracy(launched):
    from harness.report import write_report

    root, _, all_cases, _, _ = launched
    report = write_report(root / all_cases[0].name).read_text()
    assert (root / all_cases[0].name / "preference.png").stat().st_size > 0
    assert "preference.png" in report and "reward margin (chosen - rejected)" in report


@pytest.mark.multirank
def test_the_step_and_done_lines_and_the_report_show_margins_and_accuracies(launched):
    """Every case's [step] lines name loss, rewards_margin and rewards_accuracy with metrics.jsonl's values; [done],
    summary.json and the report's headline their first -> last; the report's preference section the same numbers
    (first, last, min, max) beside the last evaluation's, and preference.png."""
    from helpers.readouts import check_done_line, check_report, check_step_lines

    root, _, all_cases, proc, _ = launched
    watched = ("loss", "rewards_margin", "rewards_accuracy")
    for i, case in enumerate(all_cases):
        output = job_output(proc.stdout, i)
        assert check_step_lines(output, root / case.name, watched) == STEPS, case.name
        check_done_line(output, root / case.name, watched, window=1)
    run = root / all_cases[0].name
    report = check_report(run, (*watched, "rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected"), 1,
                          {"preference.png": ("reward margin (chosen - rejected)", "reward accuracy")})
    ends = check_done_line(job_output(proc.stdout, 0), run, watched, window=1)
    assert (f"- {STEPS} steps logged: " + ", ".join(f"{k} {a:.4f} -> {b:.4f}" for k, (a, b) in ends.items())) in report
    evals = records(run, "eval")[-1]
    assert (f"Last evaluation (step {STEPS}): eval_loss {evals['eval_loss']:.4f}, eval_rewards_margin "
            f"{evals['eval_rewards_margin']:.4f}, eval_rewards_accuracy {evals['eval_rewards_accuracy']:.4f}") in report
    assert f"## Preference: margins and accuracies ({all_cases[0].objective})" in report


def test_label_logps_equal_log_softmax_in_value_and_gradient():
    import torch

    from harness.train.objectives import label_logps

    torch.manual_seed(0)
    logits = torch.randn(4, 7, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (4, 7))
    labels[:, :3], labels[1, 5:] = -100, -100
    sums, counts = label_logps(logits, labels)
    target = labels[:, 1:]
    plain = torch.log_softmax(logits[:, :-1], -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    want = (plain * (target != -100)).sum(-1)
    assert torch.allclose(sums, want, rtol=1e-12) and counts.tolist() == [4, 2, 4, 4]
    weights = torch.arange(1.0, 5.0, dtype=torch.float64)
    got_grad, = torch.autograd.grad((sums * weights).sum(), logits)
    want_grad, = torch.autograd.grad((want * weights).sum(), logits)
    assert torch.allclose(got_grad, want_grad, rtol=1e-12, atol=1e-15)


def _validate(tmp_path, recipe: dict, capsys) -> str:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert main(["validate", str(path), "--world-size", "4"]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("parallel,key", [({"pipeline": 2}, "parallel.pipeline"), ({"tensor": 2}, "parallel.tensor"),
                                          ({"sequence": 2}, "parallel.sequence")])
def test_pipeline_tensor_and_sequence_parallel_are_refused_with_the_reason(tmp_path, capsys, parallel, key):
    err = _validate(tmp_path, {"description": "dpo", "parallel": parallel, "train": {"objective": "dpo"}}, capsys)
    assert f"{key}: {key.split('.')[1]} 2 with objective dpo is not implemented" in err and "fix:" in err


@pytest.mark.parametrize("block,message", [
    ({"train": {"objective": "ipo", "tiled_loss": True}}, "train.tiled_loss: the tiled LM loss with objective ipo"),
    ({"train": {"objective": "dpo"}, "moe": {"aux_loss": True}},
     "moe.aux_loss: the router's balancing loss with objective dpo is not implemented")])
def test_the_tiled_lm_loss_and_a_balancing_loss_are_refused(tmp_path, capsys, block, message):
    assert message in _validate(tmp_path, {"description": "pref", **block}, capsys)


def test_a_reference_mode_on_a_reference_free_objective_is_refused(tmp_path, capsys):
    err = _validate(tmp_path, {"description": "simpo", "train": {"objective": "simpo"},
                               "preference": {"reference_mode": "engine", "reference": "x"}}, capsys)
    assert "reference_mode 'engine' with objective simpo: simpo has no reference model" in err
    assert "preference.reference: a reference model (x) with objective simpo" in err


def test_adapter_mode_without_lora_is_refused(tmp_path, capsys):
    err = _validate(tmp_path, {"description": "dpo", "train": {"objective": "dpo"},
                               "preference": {"reference_mode": "adapter"}}, capsys)
    assert "reference_mode adapter without LoRA" in err and "set adapter.type=lora" in err


def test_a_reference_of_another_architecture_exits_2_before_ranks(tmp_path, capsys):
    from harness.dist import ONE_PROCESS
    from harness.run import main as run_main

    llama, qwen = llama_folder(tmp_path / "llama"), qwen2_folder(tmp_path / "qwen2")
    data = write_pairs(tmp_path / "pairs.jsonl", count=8)
    argv = ["--recipe", "ddp", "--set", "precision=fp32", "--set", f"train.model={llama}", "--set",
            f"train.dataset={data}", "--set", "train.objective=dpo",
            "--set", f"preference.reference={qwen}",
            "--set", "train.steps=1", "--output-dir", str(tmp_path / "run")]
    assert run_main(argv, launch=ONE_PROCESS) == 2
    err = capsys.readouterr().err
    assert "preference.reference: model_type 'qwen2' of the reference, 'llama' of the policy" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_adapters_off_is_the_base_model_and_restores_the_adapters():
    import torch

    from harness.config.recipes import load_recipe
    from harness.model import adapters
    from harness.model.hf import build_model
    from harness.train.reference import adapters_off

    model = build_model("tiny-llama", seed=1).float().train()
    ids = torch.randint(0, 100, (1, 8))
    base = model(input_ids=ids).logits
    adapters.apply(model, {"adapter": load_recipe("lora_zero2")[0]["adapter"], "train": {"seed": 1},
                           "activation_checkpointing": False})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.add_(0.1)  # adapters that change the output (B starts at 0)
    tuned = model(input_ids=ids).logits
    with adapters_off(model):
        off = model(input_ids=ids).logits
    assert torch.equal(off, base) and not torch.allclose(tuned, base)
    assert model.training and torch.equal(model(input_ids=ids).logits, tuned)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
