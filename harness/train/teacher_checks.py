"""A distillation run's teacher against the student, before any rank starts (its config.json and tokenizer files
only): the loss compares the two distributions token by token, so both must have one vocabulary and one
tokenizer. Cross-tokenizer distillation (TRL's GOLD) is out of scope for now."""

from __future__ import annotations

from harness.config.distill_rules import is_distill
from harness.errors import Problem, UsageError

KEY = "distill.teacher_model_name_or_path"
FIX = ("use a teacher of the student's family and tokenizer (e.g. a larger model of the same release), or leave "
       "distill.teacher_model_name_or_path null (the student's starting weights)")


def teacher_problems(recipe: dict, cfg: dict, model_config) -> list[Problem]:
    """cfg: the student's config.json (harness/train/checks.inputs); model_config: name -> a model's config dict
    (harness/train/checks.model_config)."""
    teacher = recipe.get("distill", {}).get("teacher_model_name_or_path") if is_distill(recipe) else None
    if teacher is None:
        return []
    student = recipe["train"]["model"]
    try:
        other = model_config(teacher)
    except UsageError as e:
        return [Problem(KEY, str(e).split("\n")[0], "check the teacher's path or hub id")]
    if other.get("vocab_size") != cfg.get("vocab_size"):
        return [Problem(KEY, f"vocab_size {other.get('vocab_size')!r} of the teacher ({teacher}), "
                        f"{cfg.get('vocab_size')!r} of the student ({student}): the divergence compares the two "
                        "distributions over one vocabulary, token by token", FIX)]
    return _tokenizer_problems(teacher, student)


PROBE = "Question: What is 18 + 15?\nAnswer: 33. The quick brown fox, naïve café, 東京 <|eos|>"


def _tokenizer_problems(teacher: str, student: str) -> list[Problem]:
    """One vocabulary (token -> id), one eos id and the same ids for a probe text: the tokenizers' files may differ
    (a class name written by another transformers version) while the ids are the same."""
    from harness.model.hf import load_tokenizer

    try:
        ours, theirs = load_tokenizer(student), load_tokenizer(teacher)
    except (OSError, ValueError) as e:
        return [Problem(KEY, f"the teacher's tokenizer ({teacher}) does not load: {str(e).splitlines()[0]}", FIX)]
    same = (ours.get_vocab() == theirs.get_vocab() and ours.eos_token_id == theirs.eos_token_id
            and ours(PROBE)["input_ids"] == theirs(PROBE)["input_ids"])
    if not same:
        return [Problem(KEY, f"the teacher's tokenizer ({teacher}) is not the student's ({student}): the same "
                        "text gives other ids, so the teacher's distribution at a position is over other tokens",
                        FIX)]
    return []
