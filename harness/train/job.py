"""One training job on one rank: run folder, data, model, engine, trainer. Called by harness/run.py."""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import sys
from pathlib import Path

from harness import dist as distmod
from harness import profiling
from harness.checkpoint import files as ckpt_files
from harness.checkpoint import relayout, resume
from harness.checkpoint import save as checkpoint
from harness.config.jsonio import dump_json
from harness.config import readouts
from harness.config.objectives import objective_of, readout_of
from harness.config.preference_rules import is_preference
from harness.config.recipes import deep_merge
from harness.config.resolve import render_provenance
from harness.distill.served import TeacherUnavailable
from harness.errors import GeneratorFailed, UsageError, without_secrets
from harness.log import quiet_scheduler_construction, say
from harness.data.stream_rows import StreamRows
from harness.model import adapters, fp8
from harness.model.lora_attach import attach
from harness.model.moe.wiring import prepare_model as prepare_moe
from harness.trackers import start as start_trackers, summary_metrics
from harness.train import checks, faults, preempt, restarts, schedule, stochastic_round, vision_steps
from harness.train.metrics import MetricsLog, read_metrics
from harness.train.trainer import Boundaries, Data, Trainer


def choose_run_dir(spec, dist) -> Path:
    """Explicit --output-dir, else <output_dir>/<date>_<recipe>[-N] picked by rank 0 and broadcast."""
    if spec.output_dir is not None:
        return spec.output_dir
    name = None
    if dist.is_main:
        base = Path(spec.recipe["train"]["output_dir"]) / f"{datetime.date.today():%Y-%m-%d}_{spec.recipe_name}"
        name, n = base, 1
        while name.exists():
            n += 1
            name = base.with_name(f"{base.name}-{n}")
    return Path(distmod.broadcast_object(str(name)))


def write_run_files(spec, run_dir: Path) -> None:
    if spec.overwrite and spec.resume is None:
        for old in ("checkpoints", "metrics.jsonl", "summary.json"):
            target = run_dir / old
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if spec.resume is None else f".resume{len(list(run_dir.glob('ds_config*.json')))}"
    (run_dir / f"recipe{suffix}.json").write_text(dump_json(spec.recipe))
    (run_dir / f"ds_config{suffix}.json").write_text(dump_json(spec.ds_config))
    (run_dir / f"provenance{suffix}.json").write_text(dump_json(spec.provenance))


def load_data(spec, dist, tokenizer) -> Data:
    """Rows of the prepared token store for the recipe's data (prepared here, once, if there is none)."""
    import time

    from harness.data.corpus import DataSpec
    from harness.data.formats import check_chat_template
    from harness.data.rows import Rows, split_rows
    from harness.data.store import empty_rows_note, ensure_store

    start = time.perf_counter()
    train = spec.recipe["train"]
    if objective_of(spec.recipe).family == "rl":  # an RL run's prompt set (harness/rl/prompts.py)
        from harness.train import grpo_start

        return grpo_start.load_prompts(spec, dist, tokenizer)
    if objective_of(spec.recipe).family == "distill":  # gkd: prompt + completion, distill: prompts; one per row
        from harness.train.distill_data import load_completions

        train_rows, eval_rows, lines = load_completions(spec, tokenizer)
        for line in lines if dist.is_main else ():
            say("data", line)
        return Data(train=train_rows, eval=eval_rows)
    if train["objective"] != "lm":  # preference pairs (harness/data/preference.py), not packed rows
        from harness.data.preference import load_pairs

        train_pairs, eval_pairs, lines = load_pairs(spec, dist, tokenizer)
        for line in lines if dist.is_main else ():
            say("data", line)
        return Data(train=train_pairs, eval=eval_pairs)
    if vision_steps.is_vision_run(spec):  # chat records with images: the vision store, conversations packed whole
        train_rows, eval_rows, lines = vision_steps.load_data(spec, dist, tokenizer)
        for line in lines if dist.is_main else ():
            say("data", line)
        return Data(train=train_rows, eval=eval_rows)
    if train["datasets"]:  # a mixture (harness/data/mixture.py)
        from harness.data import mixture

        mix, train_rows, eval_rows, lines = mixture.load(train, dist.local_rank, tokenizer)
        for line in lines if dist.is_main else ():
            say("data", line)
        return Data(train=train_rows, eval=eval_rows, mixture=mix)
    data_spec = DataSpec.from_train(train)
    if data_spec.uses_chat_template:  # every rank, so all exit with the message before any waits on a store
        check_chat_template(tokenizer, train["model"], data_spec.format)
    if train["streaming"]:
        return load_streamed(spec, dist, tokenizer, data_spec, start)
    store, made = ensure_store(data_spec, tokenizer, train["seq_len"], train["store_dir"] or None, dist.local_rank)
    train_rows, eval_rows = split_rows(Rows.of(store, train["packing"]), train["eval_fraction"], train["seed"])
    if dist.is_main:
        meta = store.meta
        say("data", f"{'prepared' if made else 'using'} store {store.path}: {meta['documents']} documents, "
                    f"{meta['tokens']} tokens ({meta['dtype']}), {meta['rows']} rows, format {meta['format']}; "
                    f"data ready in {time.perf_counter() - start:.2f}s")
        if note := empty_rows_note(meta):
            say("data", f"warning: {note}")
    return Data(train=train_rows, eval=eval_rows)


def load_streamed(spec, dist, tokenizer, data_spec, start: float) -> Data:
    """train.streaming: the shard store being written by this node's writer (harness/data/stream_rows.py)."""
    import time

    from harness.data.stream_rows import load_stream

    batch = spec.run.batch
    train_rows, eval_rows, store = load_stream(data_spec, tokenizer, spec.recipe["train"], dist.local_rank,
                                               dist.is_main, batch.micro_batch * batch.grad_accum * spec.dp)
    if dist.is_main:
        state = "done" if store.done else "being written"
        say("data", f"streaming store {store.path} ({state}): {store.num_shards} shards of {store.shard_rows} rows "
                    f"published, {train_rows.known_rows} training rows so far; data ready in "
                    f"{time.perf_counter() - start:.2f}s")
    return Data(train=train_rows, eval=eval_rows)


def eager_muon_on_cpu(ds_config: dict) -> str | None:
    """DeepSpeed's muon_update is torch.compile'd; on a CPU machine inductor spends minutes compiling it per matrix
    shape (measured: a 2-layer tiny Llama had not finished its first step after 3 minutes). The eager function is
    the same arithmetic, so on CPU the harness runs it eagerly."""
    import torch

    if str((ds_config.get("optimizer") or {}).get("type", "")).lower() != "muon" or torch.cuda.is_available():
        return None
    torch._dynamo.config.disable = True
    return "optimizer: Muon on CPU: torch.compile is off (DeepSpeed's muon_update runs eagerly; inductor on CPU " \
           "takes minutes per matrix shape)"


def build_engine(spec, startup):
    """(engine, ModelInfo, notes): the model built for this rank (harness/model/load), then the engine, each phase
    timed and its peak memory recorded by `startup` (harness/profiling/startup.py); notes are what the build says
    for the start-up lines (how it loaded, MoE, LoRA). The HF model object is not kept."""
    import deepspeed

    from harness.model.build import build

    with startup.phase("build"):
        built = build(spec)
    startup.predicted = profiling.predict_build(spec, built)  # the base as built (ZeRO-3: partitioned)
    notes, mpu = list(built.notes), built.mpu
    if spec.pp == 1 and (line := prepare_moe(built.module, spec.recipe, spec.ds_config)):
        notes.append(f"moe: {line}")  # the router's loss; AutoEP's shim (harness/model/moe)
    if spec.pp == 1:  # LoRA; pipeline stages get theirs in pipe_engine.build_stage, once each is materialised
        from harness.model.sequence import steps as sequence

        if sequence.uses_sequence_path(spec):  # attention, tiling; Ulysses' mpu (SP with tp is refused)
            mpu = sequence.prepare(built.module, spec) or built.mpu
        tp_group = built.mpu and (built.mpu.tp_group, built.mpu.tp_rank, spec.tp)
        if note := attach(built.module, spec, hf_model=built.module, tp_group=tp_group):
            notes.append(note)
        if note := fp8.convert(built.module, spec.recipe):  # after LoRA (refused with it), before the engine
            notes.append(note)
    if note := eager_muon_on_cpu(spec.ds_config) or stochastic_round.eager_on_cpu(spec.recipe):
        notes.append(note)
    with startup.phase("engine_setup"), quiet_scheduler_construction():
        chosen = stochastic_round.initialize_args(adapters.param_groups(built.module, spec.recipe), spec.recipe)
        engine, *_ = deepspeed.initialize(model=built.module, config=spec.ds_config, mpu=mpu, **chosen)
    return engine, built.info, notes


def universal_form(spec, dist, run_dir: Path) -> tuple[Path, str]:
    """The resume point's universal form, converted here once if it has none yet; a conversion's time and peak
    memory (rank 0's) go to RUN/conversions.jsonl."""
    point, meter = spec.resume_point, profiling.Startup(dist.device)
    with meter.phase("conversion"):
        ckpt_dir, tag, converted = resume.universal(point, dist, ep=spec.run.degrees.ep)
    if converted:
        run = spec.run.degrees
        here = {"world_size": spec.world_size, "dp": spec.dp, "tp": spec.tp, "pp": spec.pp, "sp": run.sp,
                "ep": run.ep, "zero_stage": spec.zero_stage}
        line = relayout.record(run_dir, point, here, meter.records["conversion"])
        say("ckpt", f"converted {point.tag} in {line['seconds']:.2f}s, peak private memory "
                    f"{line['peak_rss_anon_bytes'] / 2**20:,.0f} MiB (recorded in {run_dir / relayout.CONVERSIONS})")
    return ckpt_dir, tag


def start_step(engine, spec, dist, run_dir: Path, info) -> tuple[int, dict]:
    """(the step to start at, the loaded checkpoint's client state: {} when starting afresh). `info`: the built
    model's ModelInfo (a pipeline's partition names its parameters)."""
    point = spec.resume_point
    if point is None:
        schedule.align(engine, 0)  # step 1 trains at the first warmup value, not lr 0 (train/schedule.py)
        return 0, {}
    launched_lrs = schedule.group_lrs(engine)  # the load restores the saving run's
    for tag in point.skipped if dist.is_main else ():
        say("ckpt", f"skipped {point.ckpt_dir / tag}: incomplete (no {ckpt_files.MANIFEST}, its save was interrupted)")
    if spec.ds_config.get("checkpoint", {}).get("load_universal"):
        ckpt_dir, tag = universal_form(spec, dist, run_dir)
        with relayout.hf_names_while_loading(engine, info.partition):
            client = checkpoint.load(engine, dist, ckpt_dir, tag, rng_dir=point.folder,
                                     strict=not checkpoint.frozen_excluded(spec))
    else:
        client = checkpoint.load(engine, dist, point.ckpt_dir, point.tag, strict=not checkpoint.frozen_excluded(spec))
    step = int(client.get("step", point.step))
    later = ckpt_files.later_tags(run_dir / "checkpoints", step)
    if later and not spec.overwrite:
        raise UsageError(f"resuming at step {step} would overwrite later checkpoints ({', '.join(later)})\n"
                         "    fix: --resume the latest one, pass --overwrite, or use another --output-dir")
    lrs = schedule.align(engine, step, launched_lrs)  # this launch's schedule from the first resumed step on
    if dist.is_main:
        say("ckpt", f"resumed {point.folder} at step {step}")
        line = schedule.resume_line(point.tag, point.manifest.get("schedule"), checkpoint.schedule_of(spec.ds_config),
                                    step, lrs)
        if line:
            say("ckpt", line)
    return step, client


def announce(spec, dist, run_dir: Path, info, data: Data, notes: list[str]) -> None:
    """The start-up lines (rank 0); `notes`: the resolve's (spec.notes) and the build's."""
    if not dist.is_main:
        return
    n_params, batch = info.num_params, spec.run.batch  # the whole model's, counted before any split
    say("config", f"recipe {spec.recipe_name} | world {spec.world_size} ({dist.backend}) | zero {spec.zero_stage}"
                  f" | tp {spec.tp} pp {spec.pp} dp {spec.dp} | {spec.run.precision}"
                  f" ({info.train_dtype} weights, checkpoint {info.checkpoint_dtype or 'dtype unknown'})")
    rows = batch.micro_batch * batch.grad_accum * spec.dp
    unit, per_step = ("pairs", f"{rows} pairs = {2 * rows} sequences") if spec.run.preference else \
        ("records", f"{rows} sequences") if objective_of(spec.recipe).family == "distill" else \
        ("blocks", f"{rows} sequences")
    if objective_of(spec.recipe).family == "rl":  # completions of prompts (harness/train/grpo.py says the rest)
        g = spec.recipe["rl"]["num_generations"]
        unit, per_step = "prompts", f"{rows} completions = {rows // g} prompts x {g} generations"
        say("batch", f"{batch.micro_batch} micro x {batch.grad_accum} accum x {spec.dp} dp = {per_step} per step, "
                     f"prompts of at most {data.train.shape[1]} tokens")
    else:
        say("batch", f"{batch.micro_batch} micro x {batch.grad_accum} accum x {spec.dp} dp = {per_step} x "
                     f"{data.train.shape[1]} tokens per step")
    say("model", f"{spec.recipe['train']['model']}: {n_params / 1e6:.2f}M params")
    what = f"mixture of {', '.join(data.mixture.names)}" if data.mixture is not None else spec.recipe['train']['dataset']
    say("data", f"{what}: {data.train.shape[0]} train / {data.eval.shape[0]} eval {unit}")
    if spec.provenance:
        say("config", render_provenance(spec.provenance).replace("\n", "\n         "))
    for note in notes:
        say("plan", note)
    for w in spec.warnings:
        say("warn", w.render())
    say("config", f"run folder {run_dir}")


def mixture_from(spec, dist, data: Data, step0: int, client: dict, log: MetricsLog) -> Data:
    """A mixture's blend continued from the checkpoint (weights changed: from this step on), and the epochs each
    source gives over the run (start-up lines)."""
    from harness.data.mixture import epoch_lines
    from harness.train.faults import DataSteps

    global_batch = spec.run.batch.micro_batch * spec.run.batch.grad_accum * spec.dp
    mix, note = data.mixture, None
    if client:
        position = DataSteps(client.get(faults.CLIENT_KEY, ())).batch(step0) * global_batch
        mix, note = mix.resumed(client, position)
        if note and dist.is_main:
            say("data", note)
    lines, record = epoch_lines(mix, data.train.sizes, data.eval.sizes, global_batch, step0,
                                spec.recipe["train"]["steps"])
    if dist.is_main:
        for line in lines:
            say("data", line)
        log.write("mixture", step0, **record, note=note)
    return dataclasses.replace(data, mixture=mix)


def write_summary(spec, run_dir: Path, step0: int, result: dict) -> dict:
    """summary.json, and the [done] line: this launch's first -> last of what the objective's user watches
    (harness/config/readouts.py), from the train records metrics.jsonl holds."""
    records = {r["step"]: r for r in read_metrics(run_dir) if r.get("kind") == "train" and r["step"] > step0}
    found = readouts.ends(readout_of(spec.recipe), [records[s] for s in sorted(records)])
    summary = {"run_dir": str(run_dir), "recipe": spec.recipe_name, "world_size": spec.world_size,
               "steps": result.get("preempted_at", spec.recipe["train"]["steps"]), "start_step": step0, **result,
               "readouts": found}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say("done", f"{summary['steps']} steps, {readouts.ends_text(found)}; outputs in {run_dir}")
    return summary


def quiesce(engine) -> None:
    """Leave no collective in flight before the process exits. ZeRO-3 prefetches parameters with async
    all-gathers that nothing waits for after the last forward (the checkpoint's probe); wait for them and
    release what they gathered, then meet the other ranks. Success path only: after an error a peer may never
    reach the barrier."""
    engine.empty_partition_cache()
    distmod.barrier()


def main(spec) -> int:
    timeout_min = spec.recipe["train"]["collective_timeout"]
    dist = distmod.init(timeout_min)
    try:
        return run(spec, dist)
    except Exception as e:
        if distmod.is_timeout(e):
            raise distmod.CollectiveTimeout(dist.rank, timeout_min, e,
                                            distmod.silent_peers(dist.rank, timeout_min)) from None
        raise
    finally:
        distmod.teardown()


def run(spec, dist) -> int:
    """One job in an existing process group (main's; or a test driver's, running several jobs in one group)."""
    from harness.model.hf import load_tokenizer

    log = trackers = data = None
    code = 1  # an exception escaping: the trackers record a failed run
    try:
        run_dir = choose_run_dir(spec, dist)
        # the profiler's and monitors' keys need the run folder; they change nothing spec.run describes
        spec = dataclasses.replace(spec, ds_config=deep_merge(spec.ds_config, profiling.ds_overrides(spec, run_dir)))
        if dist.is_main:
            restarts.report_run_dir(run_dir)  # `harness launch --max-restarts` restarts in this folder
            write_run_files(spec, run_dir)
        distmod.barrier()
        trackers = start_trackers(spec, dist, run_dir)  # exit 2 on every rank when one cannot start
        tokenizer = load_tokenizer(spec.recipe["train"]["model"])
        data = load_data(spec, dist, tokenizer)
        if vision_steps.is_vision_run(spec):  # the planner's prediction counts the data's images
            spec = vision_steps.with_vision_load(spec, data.train)
        if objective_of(spec.recipe).family != "rl":  # an RL step's prompts: harness/rl/prompts.py
            checks.data_fits(spec, data.train.shape[0], data.train.shape[1])  # same data on every rank: all exit 2
        if is_preference(spec.recipe):  # before the policy is built: a precomputed reference runs and is freed first
            from harness.train import reference

            data = dataclasses.replace(data, reference=reference.start(spec, dist, data, run_dir, say))
        elif objective_of(spec.recipe).family == "distill":  # the teacher, built before the student as a reference
            from harness.train import teacher

            data = dataclasses.replace(data, reference=teacher.start(spec, dist, say, data, tokenizer))
        startup = profiling.Startup(dist.device)
        engine, info, notes = build_engine(spec, startup)
        log = MetricsLog(run_dir, enabled=dist.is_main)
        announce(spec, dist, run_dir, info, data, [*spec.notes, *notes])
        lines, startup_summary = profiling.report_startup(startup)
        for line in lines if dist.is_main else ():
            say("memory", line)
        step0, client = start_step(engine, spec, dist, run_dir, info)
        if data.mixture is not None:
            data = mixture_from(spec, dist, data, step0, client, log)
        if objective_of(spec.recipe).family == "rl":
            from harness.train import grpo_start

            data = grpo_start.steps(spec, dist, data, run_dir, engine, tokenizer, step0, client)
        if dist.is_main:
            checkpoint.save_hf_files(run_dir / "checkpoints", info.config, tokenizer,
                                     vision_steps.image_processor(spec))  # None: a text-only model
        hooks = profiling.make_hooks(spec, engine, dist, run_dir, log, trackers)
        with preempt.Preemption() as stop:  # until the end: a later signal (the launcher's) must not cut the exit
            trainer = Trainer(engine, spec, dist, data, run_dir, log, Boundaries(tuple(hooks), stop),
                              model_info=info, skipped_batches=client.get(faults.CLIENT_KEY, ()))
            try:
                result = trainer.run(step0)
            except (faults.NumericFault, GeneratorFailed) as e:  # every rank raises it in the same step; rank 0 says it
                if dist.is_main:
                    say("fault", str(e))
                code = getattr(e, "exit_code", faults.EXIT_NUMERIC_FAULT)
                return code
            result.update(startup_summary)
            if isinstance(data.train, StreamRows):  # streaming: how long rank 0 waited for its node's writer
                result["stream_wait_s"] = round(data.train.store.waited_s, 3)
            for hook in hooks:
                result.update(hook.close() or {})
            if dist.is_main:
                summary = write_summary(spec, run_dir, step0, result)
                trackers.summary(summary_metrics(summary), summary["steps"])
            quiesce(engine)
        code = preempt.EXIT_PREEMPTED if "preempted_at" in result else 0
        return code
    except TeacherUnavailable as e:  # a served teacher's outage, not bad input: a code the launchers retry
        if dist.is_main or dist.local_rank == 0:
            print(f"error: {without_secrets(str(e))}", file=sys.stderr)
        code = preempt.EXIT_TEACHER_UNAVAILABLE
        return code
    finally:
        if data is not None and hasattr(data.train, "close"):  # a streamed store: this node's writer stops
            data.train.close()
        if trackers is not None:
            trackers.finish(code)
        if log:
            log.close()
