"""The teacher of a distillation run (train.objective gkd, distill): what the step asks per micro-batch, in one of
the teacher modes (distill.teacher_mode; harness/config/distill_rules.teacher_mode resolves auto).

engine   a frozen DeepSpeed engine of distill.teacher_model_name_or_path (null: the student's starting weights), built
         by the reference's machinery (train/reference_engine.py): no optimizer, ZeRO-3-sharded where the student is
         (its offload_param too), else a whole copy in the run's precision; a no_grad forward per micro-batch
adapter  under LoRA the student's own base with the adapters switched off (self-distillation; no second copy), a
         no_grad forward through the student's engine (train/reference.adapters_off)
precomputed, served   the teacher's top-k: a store written once before training, or a vLLM-API server asked per
         micro-batch (train/teacher_topk.py, harness/distill/)

The seam: `Teacher.targets(student_engine, input_ids, where)` -> harness/train/distill_loss.Targets at the loss
tokens `where` ([B, L - 1] bool, labels[:, 1:] != -100): the logits over the whole vocabulary here; a top-k teacher
(precomputed, served) answers with ids and log-probs instead, and the loss is picked by the answer's kind
(distill_loss.LOSSES). The teacher never reaches a checkpoint or an export (it is not part of the student's engine).
"""

from __future__ import annotations

import dataclasses

import torch

from harness.config.defaults import PRECISION_BYTES
from harness.config.distill_rules import teacher_mode
from harness.train import teacher_topk
from harness.train.distill_loss import Targets
from harness.train.reference import adapters_off
from harness.train.reference_engine import build_engine, reference_name


@dataclasses.dataclass
class Teacher:
    mode: str
    engine: object = None  # engine mode: the frozen teacher engine

    @torch.no_grad()
    def targets(self, student, input_ids: torch.Tensor, where: torch.Tensor, ids=None) -> Targets:
        if self.mode == "engine":
            logits = self.engine(input_ids=input_ids.to(self.engine.device), use_cache=False).logits
        else:
            with adapters_off(student.module):
                logits = student(input_ids=input_ids.to(student.device), use_cache=False).logits
        return Targets(logits=logits[:, :-1][where.to(logits.device)])

    def generator(self, rl: dict, student, tokenizer, run):
        """seq_kd: the generator of the teacher's completions (harness/rl/generation; rl: its settings): HF generate
        on the teacher engine (under ZeRO-3 its gathers, collective as the student's), or on the student's engine
        with the adapters off (adapter)."""
        from harness.rl.generation import make_generator

        if self.mode == "engine":
            return make_generator(rl, self.engine, tokenizer, run)
        return AdaptersOffGenerator(make_generator(rl, student, tokenizer, run), student.module)


@dataclasses.dataclass
class AdaptersOffGenerator:
    """A generator on the student's engine that samples from its base: the adapter mode's teacher."""
    inner: object
    module: object

    def generate(self, prompt_ids: list[list[int]], **kwargs) -> list[list[int]]:
        with adapters_off(self.module):
            return self.inner.generate(prompt_ids, **kwargs)


def why_mode(spec) -> str:
    """Why the run has its teacher mode: the user's choice, or what auto saw."""
    block = spec.recipe["distill"]
    if block["teacher_mode"] != "auto":
        return f"distill.teacher_mode {block['teacher_mode']}"
    if teacher_mode(spec.recipe) == "served":
        return "auto: a teacher server is named"
    if teacher_mode(spec.recipe) == "adapter":
        return "auto: LoRA and no teacher named, so the student's own base is the teacher"
    return "auto: " + ("a teacher model is named" if block["teacher_model_name_or_path"] else
                       "no LoRA, so the student's starting weights are copied")


def start(spec, dist, say, data=None, tokenizer=None):
    """The run's teacher, announced on rank 0 with what it costs and why this mode; built before the student (an
    engine's ZeRO-3 partitioning runs on every rank alike). data, tokenizer: the run's records and tokenizer (the
    precomputed store's rows and key)."""
    mode = teacher_mode(spec.recipe)
    if mode == "precomputed":
        teacher, line = teacher_topk.precomputed(spec, data.train.every_record(), tokenizer)
    elif mode == "served":
        teacher, line = teacher_topk.served(spec)
    elif mode == "adapter":
        teacher = Teacher(mode)
        line = ("teacher: adapter (the student's base with the LoRA adapters off): no second copy, one more forward "
                "per micro-batch")
    else:
        engine, info = build_engine(spec)
        teacher = Teacher(mode, engine=engine)
        params, width = info.num_params, PRECISION_BYTES[spec.run.precision]
        shards = spec.world_size if spec.zero_stage == 3 else 1
        line = (f"teacher: engine of {reference_name(spec)}: {info.num_params / 1e6:.2f}M params, "
                f"{params * width / shards / 2**20:.2f} MiB of {spec.run.precision} weights per rank "
                f"({'ZeRO-3 sharded' if shards > 1 else 'a whole copy'}), one more forward per micro-batch")
    if dist.is_main:
        say("distill", f"{line} ({why_mode(spec)})")
    return teacher
