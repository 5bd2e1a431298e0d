"""Knowledge distillation's teachers that give top-k targets (train.objective gkd / distill, teacher modes
`precomputed` and `served`): the teacher's top-k ids and log-probs for every loss token (topk.py), the loss over
that support with TRL's tail bucket (topk_loss.py), the precomputed store written once beside the token store and
memory-mapped by every rank (teacher_store.py), and the client of a vLLM-compatible endpoint that returns top-k
prompt log-probs (served.py). The step that feeds them to the student's engine lives in train/.

May import: data/ and the ground floor."""
