"""GRPO and its kin (issue 38) on real DeepSpeed ranks against a plain-torch GRPO written from the formulas
(tests/helpers/grpo_ref.py). A fixed batch goes in through rl.replay: 3 prompts x 4 completions with EOS, junk after
EOS, a truncated completion and a zero-std group; micro 3 x accum 2 x 2 ranks. Per case: the loss and the grad norm
of step 1 within 1e-6, and step 2's (after one SGD step of lr 1, no clipping) within 1e-5, on ZeRO-0 (ddp: the
harness's own norm, harness/train/zero0_step.py), ZeRO-1/2/3 and offload, with beta 0 and 0.04 (a reference engine,
ZeRO-3-sharded on ZeRO-3), temperature 0.7, perturbed old_logps, GSPO and every loss_type; and TRL's clip metrics
(clip_ratio/low_mean, high_mean, region_mean, low_min, high_max; cispo_clip_ratio; none for sapo) of both steps within
1e-6, reduced over ranks and micro-batches as TRL's GRPOTrainer reduces them. dapo, grpo and dr_grpo are compared with the batch as ONE micro-batch on one rank (the
split 6 + 6 over ranks leaves them unchanged); LoRA with its zero-initialised adapter gives the full model's values.
The same launch runs online RL with generation in the loop:
- the built-in toy task (harness/rl/toy.py, reply in vowels) on the built-in tiny Llama: the mean reward rises from
  the untrained ~0.23 on ZeRO-2, ZeRO-3 and LoRA (TRL's GRPOTrainer on the same task and hyperparameters: bench/rl.py);
- a run stopped mid-generation (num_iterations 2, saved at step 1) and resumed equals the uninterrupted run: the
  losses and rollouts.jsonl, byte for byte; resumed on 1 rank instead of 2, and a 1-rank run resumed on 2 (each
  1-rank run a launch of its own, one plain process): the weights (exported, loaded with transformers: the engine's
  logits) and the completions equal too, the first logged loss within one float32 ulp;
- rl.replay of the uninterrupted run's rollouts.jsonl reproduces its losses bit for bit.
The refusals run without ranks.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from harness.cli import main
from helpers.grpo_ref import Case, close, expected, perturbed_old, records, write_replay
from helpers.launch import job_output, launch_jobs, records as metric_records, set_args
from helpers.models import llama_folder, perturbed_folder

MICRO, GAS, WORLD, STEPS, LR = 3, 2, 2, 2, 1.0
# 2 -> 1 and 1 -> 2 ranks: the weights after the resume equal the uninterrupted run's bit for bit (each micro-batch
# holds the same 8 rows, and its gradient's 1/2 is exact whether it is the rank average or the accumulation
# average). The logged loss averages the same two micro-batch losses by another route on 1 rank (the accumulation
# sum, not the ranks' all-reduce): measured 1 float32 ulp (3.7e-9) at step 2 after 2 -> 1, 0 elsewhere
MOVED_TOL = 1e-8
SPLIT_FREE = ("dapo", "grpo", "dr_grpo")  # unchanged by how the batch is split


def cases(ref: str) -> list[Case]:
    return [Case("ddp_dapo_old", "ddp", old_shift=0.3),
            Case("zero1_grpo_kl_t07", "zero1", {"loss_type": "grpo", "beta": 0.04, "temperature": 0.7},
                 reference=ref),
            Case("zero2_bnpo_t07_masked_batch", "zero2", {"loss_type": "bnpo", "temperature": 0.7,
                                                           "mask_truncated_completions": True, "scale_rewards": "batch"}),
            Case("zero3_dr_grpo_kl", "zero3", {"loss_type": "dr_grpo", "beta": 0.04}, reference=ref),
            Case("offload_cispo_old", "zero2_offload", {"loss_type": "cispo", "epsilon_high": 1.2}, old_shift=0.3),
            Case("zero1_sapo_old", "zero1", {"loss_type": "sapo"}, old_shift=0.3),
            Case("zero2_gspo_delta_old", "zero2", {"importance_sampling_level": "sequence", "delta": 1.2},
                 old_shift=0.3),
            Case("zero3_lora_dapo_kl_adapter", "zero3", {"beta": 0.04}, lora=True)]


def argv(root: Path, model: str, case: Case, replay: Path) -> list[str]:
    sets = {"precision": "fp32", "train.steps": STEPS, "train.log_every": 1, "scheduler.type": "none",
            "optimizer.type": "sgd", "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 1e9,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": GAS, "batch.train_batch_size": '"auto"',
            "train.model": model, "train.objective": "grpo", "rl.replay": replay, "rl.num_generations": 4,
            "rl.max_completion_length": 6, **{f"rl.{k}": json.dumps(v) for k, v in case.rl.items()}}
    if case.reference:
        sets["rl.reference"] = case.reference
    if case.lora:
        sets.update({"adapter.type": "lora", "adapter.dropout": 0})
    return ["--recipe", case.recipe, "--output-dir", str(root / case.name), *set_args(sets)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    import time

    root = tmp_path_factory.mktemp("grpo")
    model = llama_folder(root / "llama")
    ref = perturbed_folder(model, root / "llama_ref")
    all_cases, argvs = cases(ref), []
    for case in all_cases:
        old = perturbed_old(model, case.old_shift, case.rl.get("temperature", 1.0)) if case.old_shift else None
        replay = write_replay(root / f"{case.name}.jsonl", STEPS, old)
        argvs.append(argv(root, model, case, replay))
    learning = root / "learning"
    learning.mkdir()
    one = one_rank(learning, [learn_argv(learning / "single", "zero2", **{**SINGLE, "train.steps": 1})])
    start = time.perf_counter()
    proc = launch_jobs(argvs + learning_cases(learning), root, ranks=WORLD, timeout_s=900)
    seconds = time.perf_counter() - start
    one += one_rank(learning, [moved_case(learning)])
    print(f"2-rank launch {seconds:.1f}s, the two 1-rank runs {one:.1f}s")
    return root, model, all_cases, proc, seconds


def one_rank(folder: Path, cases: list) -> float:
    """Seconds of a 1-rank launch: one plain process (no DeepSpeed launcher)."""
    import time

    start = time.perf_counter()
    launch_jobs(cases, folder, ranks=1, timeout_s=600, launcher=False)
    return time.perf_counter() - start


LEARN_STEPS = 15
BASE = {"train.model": "tiny-llama", "train.objective": "grpo", "precision": "fp32", "batch.micro_batch_per_gpu": 8,
        "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"', "optimizer.type": "adamw",
        "optimizer.lr": 3e-2, "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": 1.0,
        "rl.num_generations": 4, "rl.max_completion_length": 8, "train.log_every": 1, "train.save_every": 0}


TRACKED = {"monitor.csv": "true", "monitor.mlflow.enabled": "true"}  # the readouts' names (test_the_step_and_done...)
SHORT = {"train.steps": 4, "rl.num_iterations": 2, "rl.temperature": 0.9}  # the resume cases: 2 generations
SINGLE = {**SHORT, "batch.grad_accum_steps": 2}  # on 1 rank: the same global batch 16 (micro 8 x accum 2)


def learn_argv(out: Path, recipe: str, **sets) -> list[str]:
    args = ["--recipe", recipe, "--output-dir", str(out), "--profile-steps", ""]
    for key, value in {**BASE, **sets}.items():
        args += ["--set", f"{key}={value}"]
    return args


def learning_cases(root: Path) -> list[list[str]]:
    stopped = root / "stopped" / "checkpoints" / "global_step1"
    return [learn_argv(root / "zero2", "zero2", **{"train.steps": LEARN_STEPS, **TRACKED}),
            learn_argv(root / "zero3", "zero3", **{"train.steps": LEARN_STEPS}),
            # the preset's random head sits behind a frozen RMSNorm: LoRA layers alone barely move its logits
            # (entropy stays at ln 512), so the head trains as peft's modules_to_save
            learn_argv(root / "lora", "zero2", **{"train.steps": LEARN_STEPS, "adapter.type": "lora", "adapter.r": 16,
                                                 "adapter.alpha": 32, "adapter.dropout": 0,
                                                 "adapter.modules_to_save": '["lm_head"]'}),
            learn_argv(root / "whole", "zero2", **SHORT),
            # stopped at step 1, inside the first generation; resumed on the same 2 ranks (and on 1: moved_case)
            learn_argv(root / "stopped", "zero2", **{**SHORT, "train.steps": 1}),
            learn_argv(root / "stopped", "zero2", **SHORT) + ["--resume", str(stopped)],
            learn_argv(root / "replayed", "zero2", **SHORT, **{"rl.replay": root / "whole" / "rollouts.jsonl"}),
            # the 1-rank run stopped at step 1 (launched before this launch) resumed on 2 ranks
            learn_argv(root / "grown", "zero2", **SHORT) + ["--resume", str(root / "single/checkpoints/global_step1")]]


def moved_case(root: Path) -> list[str]:
    """The 2-rank run stopped at step 1, inside its first generation (num_iterations 2), resumed on 1 rank (the
    global batch 16 kept: micro 8 x accum 2): step 2 trains on the generation kept in the checkpoint, step 3
    generates its 16 completions on the one rank."""
    return learn_argv(root / "moved", "zero2", **SHORT) + ["--resume", str(root / "stopped/checkpoints/global_step1")]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["zero2", "zero3", "lora"])
def test_the_mean_reward_rises_on_the_toy_task(launched, layout):
    root, seconds = launched[0] / "learning", launched[4]
    rewards = [r["reward"] for r in metric_records(root / layout, "train")]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    print(f"{layout}: reward {first:.3f} -> {last:.3f} over {len(rewards)} steps (launch {seconds:.1f}s)")
    assert len(rewards) == LEARN_STEPS and first < 0.4 and last > first + 0.25, rewards


@pytest.mark.multirank
def test_a_resumed_run_equals_the_uninterrupted_one_rollouts_included(launched):
    root = launched[0] / "learning"
    whole, stopped = metric_records(root / "whole", "train"), metric_records(root / "stopped", "train")
    assert [r["loss"] for r in stopped] == [r["loss"] for r in whole]
    assert (root / "stopped" / "rollouts.jsonl").read_text() == (root / "whole" / "rollouts.jsonl").read_text()
    lines = [json.loads(line) for line in (root / "whole" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in lines} == {1, 3} and all(len(r["old_logps"]) > 0 for r in lines)


@pytest.mark.multirank
@pytest.mark.parametrize("run", ["moved", "grown"])  # 2 -> 1 rank, 1 -> 2 ranks
def test_a_run_resumed_on_another_world_size_continues_the_uninterrupted_one(launched, run):
    root = launched[0] / "learning"
    whole, moved = metric_records(root / "whole", "train"), metric_records(root / run, "train")
    assert [r["step"] for r in moved] == [2, 3, 4]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(moved, whole[1:])]
    print(f"{run}: resumed at step 1 on another world size: losses {[r['loss'] for r in moved]}, |diff| {diffs}")
    assert max(diffs) <= MOVED_TOL, (moved, whole)
    lines = [json.loads(x) for x in (root / run / "rollouts.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (root / "whole" / "rollouts.jsonl").read_text().splitlines()]
    same = ("step", "group", "prompt_ids", "completion_ids", "finish", "rewards", "reward", "advantage")
    assert len(lines) == 16 and [[r[k] for k in same] for r in lines] == \
        [[r[k] for k in same] for r in want if r["step"] == 3]
    old = max(abs(x - y) for a, b in zip(lines, want[16:]) for x, y in zip(a["old_logps"], b["old_logps"]))
    print(f"{run}: step 3's 16 completions equal the 2-rank run's; old_logps |diff| {old:.3g}")
    assert old <= 1e-6


@pytest.mark.multirank
def test_the_exported_policy_loads_in_transformers_and_equals_the_engine(launched, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    root, out = launched[0] / "learning", {}
    for run in ("whole", "moved", "grown"):  # 2 ranks; resumed on 1; started on 1, resumed on 2
        ckpt = root / run / "checkpoints" / "global_step4"
        assert main(["export", str(ckpt), "--out", str(tmp_path / run)]) == 0
        model = AutoModelForCausalLM.from_pretrained(tmp_path / run).eval()
        probe = torch.load(ckpt / "probe.pt", weights_only=True)
        with torch.no_grad():
            diff = (model(input_ids=probe["input_ids"]).logits - probe["logits"]).abs().max().item()
        assert diff <= 1e-5, (run, diff)
        out[run] = model.state_dict()
    worst = max((out["whole"][k] - out[run][k]).abs().max().item() for run in ("moved", "grown") for k in out["whole"])
    print(f"export: logits equal the engine's; whole vs moved and grown weights |diff| {worst:.3g}")
    assert worst == 0


@pytest.mark.multirank
def test_replaying_the_rollouts_reproduces_the_losses_bit_for_bit(launched):
    root = launched[0] / "learning"
    assert [r["loss"] for r in metric_records(root / "replayed", "train")] == \
        [r["loss"] for r in metric_records(root / "whole", "train")]


CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "cispo_clip_ratio")


@pytest.mark.multirank
def test_every_loss_type_and_layout_matches_plain_torch_grpo(launched):
    root, model, all_cases, _, seconds = launched
    worst, clipped = {}, {}
    for case in all_cases:
        old = perturbed_old(model, case.old_shift, case.rl.get("temperature", 1.0)) if case.old_shift else None
        rl = {"num_generations": 4, "max_completion_length": 6, **case.rl}
        split = rl.get("loss_type", "dapo") in SPLIT_FREE  # compared with ONE micro-batch on one rank
        micro, gas, world = (MICRO * GAS * WORLD, 1, 1) if split else (MICRO, GAS, WORLD)
        want = expected(model, records(old), rl, micro, gas, world, LR, STEPS, case.reference,
                        metric_split=(MICRO, GAS, WORLD))
        got = metric_records(root / case.name, "train")
        assert len(got) == STEPS
        steps = 1 if case.lora else STEPS  # a zero-initialised adapter: the full model's step 1 (then adapters train)
        errs = []
        for s in range(steps):
            tol = 1e-6 if s == 0 else 1e-5  # step 2 follows one SGD step of lr 1
            errs += [close(f"step{s + 1}.{key}", got[s][key], want[s][key], tol)
                     for key in ("loss", "grad_norm") if not (case.lora and key == "grad_norm")]
            names = [k for k in CLIP_METRICS if k in want[s]]
            assert names == [k for k in CLIP_METRICS if k in got[s]], (case.name, sorted(got[s]))
            errs += [close(f"step{s + 1}.{k}", got[s][k], want[s][k], 1e-6) for k in names]
            clipped.update({f"{case.name}.{k}": got[s][k] for k in names if s == 0})
        worst[case.name] = max(errs)
        if rl.get("beta"):
            assert got[0]["kl"] >= 0 and got[1]["kl"] > 0, got[1]["kl"]
    # the perturbed old_logps clip tokens both ways, so the ratios are compared where they are not 0
    nonzero = ("ddp_dapo_old.clip_ratio/low_mean", "ddp_dapo_old.clip_ratio/high_mean",
               "ddp_dapo_old.clip_ratio/high_max", "zero2_gspo_delta_old.clip_ratio/region_mean",
               "offload_cispo_old.cispo_clip_ratio")
    assert all(clipped[k] > 0 for k in nonzero), clipped
    assert "zero1_sapo_old.clip_ratio/low_mean" not in clipped  # TRL logs no clip ratio for sapo
    print(f"launch {seconds:.1f}s; worst absolute error per case: {worst}; step-1 clip metrics: {clipped}")


def test_dapo_grpo_and_dr_grpo_are_unchanged_by_the_split_and_bnpo_is_not(tmp_path):
    model = llama_folder(tmp_path / "llama")
    old = perturbed_old(model, 0.3)
    for loss_type in ("dapo", "grpo", "dr_grpo", "bnpo"):
        rl = {"num_generations": 4, "loss_type": loss_type}
        split = expected(model, records(old), rl, MICRO, GAS, WORLD, LR, steps=1)[0]["loss"]
        whole = expected(model, records(old), rl, MICRO * GAS * WORLD, 1, 1, LR, steps=1)[0]["loss"]
        assert (abs(split - whole) < 1e-6) == (loss_type != "bnpo"), (loss_type, split, whole)


@pytest.mark.multirank
def test_start_up_lines_name_the_reference_and_why_the_loss_sits_near_0(launched):
    root, _, all_cases, proc, _ = launched
    out = {c.name: job_output(proc.stdout, i) for i, c in enumerate(all_cases)}
    assert "reference: none (rl.beta 0" in out["ddp_dapo_old"]
    assert "why the loss sits near 0" in out["ddp_dapo_old"]
    assert "reference: engine of" in out["zero3_dr_grpo_kl"] and "ZeRO-3 sharded" in out["zero3_dr_grpo_kl"]
    assert "reference: adapter" in out["zero3_lora_dapo_kl_adapter"]
    lines = (root / "ddp_dapo_old" / "rollouts.jsonl").read_text().splitlines()
    assert len(lines) == STEPS * 12 and json.loads(lines[0])["group"] == 0 and json.loads(lines[11])["group"] == 2


@pytest.mark.multirank
def test_the_step_and_done_lines_the_report_and_the_trackers_show_reward_and_lengths(launched):
    """The learning run (zero2, 15 steps, trackers on): the [step] lines name reward, reward_std and
    completions/mean_length with metrics.jsonl's values and no loss; [done] and summary.json the reward and length,
    means of the first and last 3 steps; KL only where beta > 0, the clip ratio as the loss type logs it. The
    report's RL section, headline lengths and plots hold the same numbers; MLflow and the CSV monitor get them under
    the same names."""
    from harness.report.objective_plots import rl_series
    from harness.report import load_run
    from helpers.readouts import check_done_line, check_report, check_step_lines, csv_monitor, time_split_rows
    from helpers.tracker_files import mlflow_client

    root, _, all_cases, proc, _ = launched
    out = {c.name: job_output(proc.stdout, i) for i, c in enumerate(all_cases)}
    run = root / "learning" / "zero2"
    learning = job_output(proc.stdout, len(all_cases))
    watched = ("reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean")
    assert check_step_lines(learning, run, watched, hidden=("loss", "kl", "cispo_clip_ratio")) == LEARN_STEPS
    ends = check_done_line(learning, run, ("reward", "completions/mean_length"), window=3)
    check_step_lines(out["zero1_grpo_kl_t07"], root / "zero1_grpo_kl_t07", (*watched, "kl"), hidden=("loss",))
    check_step_lines(out["offload_cispo_old"], root / "offload_cispo_old", ("reward", "cispo_clip_ratio"),
                     hidden=("clip_ratio/region_mean", "kl"))
    check_step_lines(out["zero1_sapo_old"], root / "zero1_sapo_old", ("reward",),
                     hidden=("clip_ratio/region_mean", "cispo_clip_ratio"))

    rows = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "entropy",
            "clip_ratio/region_mean")
    report = check_report(run, rows, 3, {"rl_reward.png": ("reward (mean)", "reward +- reward_std",
                                                           "completions/mean_length", "frac_reward_zero_std"),
                                         "rl_policy.png": ("entropy", "clip_ratio/region_mean"),
                                         "rl_time.png": ("time/generate_s", "time/train_s")})
    (first, last), (len_first, len_last) = ends["reward"], ends["completions/mean_length"]
    assert (f"- {LEARN_STEPS} steps logged: reward {first:.4f} -> {last:.4f}, completions/mean_length "
            f"{len_first:.4f} -> {len_last:.4f} (means of the first and last 3 steps)") in report
    assert "prompts of at most 512 tokens (measured mean" in report and "completions of at most 8" in report
    assert "seq_len" not in report.split("## Flags")[0] and "loss" not in report.split("## Flags")[0]
    assert not (run / "loss.png").exists()
    for line in time_split_rows(run, ("generate_s", "score_s", "reference_s", "train_s", "sync_s")):
        assert line in report, line
    logged = metric_records(run, "train")
    drawn = rl_series(load_run(run))
    assert drawn["rl_reward.png"]["reward"] == ([r["step"] for r in logged], [r["reward"] for r in logged])
    assert drawn["rl_time.png"]["time/generate_s"][1] == [r["time/generate_s"] for r in logged]

    client, tracked = mlflow_client(run)
    for name in ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", "entropy",
                 "clip_ratio/region_mean", "time/generate_s", "rewards/vowels/mean"):
        history = {m.step: m.value for m in client.get_metric_history(tracked.info.run_id, f"train/{name}")}
        assert history == {r["step"]: r[name] for r in logged}, name
    assert tracked.data.metrics["summary/reward/first"] == first and tracked.data.metrics["summary/reward/last"] == last
    assert csv_monitor(run, "reward") == [r["reward"] for r in logged]
    assert csv_monitor(run, "completions/mean_length") == [r["completions/mean_length"] for r in logged]


def _validate(tmp_path, recipe: dict, capsys, world: int = 2) -> str:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert main(["validate", str(path), "--world-size", str(world)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("rl,message", [
    ({"num_generations": 1}, "rl.num_generations: num_generations 1: a group of one has no spread"),
    ({"num_generations": 3}, "train_batch_size 8 is not a multiple of num_generations 3 (8 / 3 = 2.67 prompts"),
    ({"loss_type": "cispo"}, "rl.epsilon_high: loss_type cispo caps the importance weight itself at epsilon_high "
                             "(0.2 from epsilon"),
    ({"beta": 0.04, "reference_mode": "precomputed"}, "reference_mode precomputed with objective grpo"),
    ({"beta": 0.04, "reference_mode": "adapter"}, "reference_mode adapter without LoRA")])
def test_what_trl_only_warns_about_is_refused_before_launch(tmp_path, capsys, rl, message):
    recipe = {"description": "grpo", "train": {"objective": "grpo"}, "batch": {"micro_batch_per_gpu": 4}, "rl": rl}
    err = _validate(tmp_path, recipe, capsys)
    assert message in err and "fix:" in err


@pytest.mark.parametrize("parallel,key", [({"pipeline": 2}, "parallel.pipeline"), ({"tensor": 2}, "parallel.tensor"),
                                          ({"sequence": 2}, "parallel.sequence")])
def test_pipeline_tensor_and_sequence_parallel_are_refused_with_the_reason(tmp_path, capsys, parallel, key):
    recipe = {"description": "grpo", "parallel": parallel, "train": {"objective": "grpo"},
              "rl": {"num_generations": 2}}
    err = _validate(tmp_path, recipe, capsys, world=4)
    assert f"{key}: {key.split('.')[1]} 2 with objective grpo is not implemented" in err and "fix:" in err
