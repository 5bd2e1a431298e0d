"""Chat data under real chat templates: what training each assistant turn in its inference context costs.

    python bench/chat.py [--records 2000]

Per template (tests/fixtures/chat_templates on the harness's tiny tokenizer, the tool-use and two-question records
of tests/helpers/chat_templates.py): records/s of rendering + tokenizing into documents (one process), documents
per record, and tokens per record beside the tokens of the conversation rendered once. Under a prefix-stable
template the ratio is 1.00; under Qwen3's, which rewrites history, it is the compute each correctly masked turn
costs in repeated context. A template renders a conversation of n assistant turns 2n + 1 times (each turn's prompt
and its own rendering, and the whole), as the turn-by-turn rendering before did.

Measured 2026-12-06 (2 cores shared by eight jobs, load average ~15: records/s are low and only comparable within
one run; 600 records):
    template         records/s  docs/record  tokens vs once  loss share
    llama3_1               101         1.00           1.00x       0.109
    qwen2_5                146         1.00           1.00x       0.150
    qwen3                   70         2.00           1.87x       0.122
    qwen3_training          84         1.00           1.00x       0.221
    gemma3                 427         1.00           1.00x       0.182
Rendering is jinja's sandbox (about 1 ms a render on an idle core); `harness data prepare --num-proc` spreads it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.chat_templates import plain_records, template_tokenizer, tool_records  # noqa: E402


def measure(name: str, records: list[dict], num: int) -> dict:
    from harness.data.chat_template import documents
    from harness.data.formats import _encode_segments

    tok = template_tokenizer(name)
    start = time.perf_counter()
    docs, whole = [], 0
    for i in range(num):
        record = records[i % len(records)]
        docs += documents(tok, record["messages"], record.get("tools"))[0]
    encoded = _encode_segments(tok, docs, tok.eos_token_id, eos_loss=0)
    seconds = time.perf_counter() - start
    for i in range(num):
        record = records[i % len(records)]
        whole += len(tok.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                             return_dict=True)["input_ids"]) + 1
    tokens = sum(map(len, encoded["input_ids"]))
    return {"records_per_s": num / seconds, "docs_per_record": len(docs) / num, "token_ratio": tokens / whole,
            "loss_share": sum(map(sum, encoded["loss_mask"])) / tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=2000)
    args = p.parse_args(argv)
    cases = [("llama3_1", tool_records(False)), ("qwen2_5", tool_records(False)), ("qwen3", tool_records(True)),
             ("qwen3_training", tool_records(True)), ("gemma3", plain_records())]
    print(f"{'template':<16}{'records/s':>10}{'docs/record':>13}{'tokens vs once':>16}{'loss share':>12}")
    for name, records in cases:
        m = measure(name, records, args.records)
        print(f"{name:<16}{m['records_per_s']:>10.0f}{m['docs_per_record']:>13.2f}{m['token_ratio']:>15.2f}x"
              f"{m['loss_share']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
