"""The run-time catalogue: bad input to `harness/run.py` (flags, recipe, DeepSpeed JSON, model, dataset, paths,
resume, this machine's DeepSpeed ops) exits 2 naming the field or file and the fix, with no traceback, before
any rank trains.

Every case is the real entry point, `harness.run.main(argv)`, with the environment a launcher would give it
(WORLD_SIZE, RANK, ...). To keep the whole catalogue cheap they run in one interpreter
(tests/drivers/catalogue.py, start-up paid once), with file descriptors 1 and 2 captured per case, so a process
group started by mistake shows ("Initializing TorchBackend"); tests/test_run_args.py runs the entry point by path.
The last cases get past every pre-init check on purpose: their problem shows only once the data is packed,
after init and before the engine is built.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "harness" / "assets"
INVALID = Path(__file__).parent / "invalid"
EXPECTED = json.loads((INVALID / "expected.json").read_text())
FIXTURE = "{fx}"  # replaced by the fixture folder in argv and env values
SECRET = "hf_catalogueSecret0123456789"
TINY = ["--set", "train.steps=1", "--set", "train.eval_every=0"]  # bounds a case that wrongly gets through
GRPO = ["--set", "train.objective=grpo", "--set", "rl.num_generations=2", "--set", "batch.micro_batch_per_gpu=2",
        "--set", "batch.train_batch_size=8",
        *TINY]
MIX = '[{{"dataset": "builtin", "weight": 0.5}}, {{"dataset": {}, "format": "{}", "weight": 0.5}}]'  # a 2-source mixture


def case(id_, argv, where, fragment, env=None, post_init=False, needs=None, silent=False):
    return {"id": id_, "argv": list(argv), "where": where, "fragment": fragment, "env": env or {},
            "post_init": post_init, "needs": needs, "silent": silent}


def from_invalid(name: str):
    """A file of the validate catalogue (tests/invalid), now through harness/run.py."""
    exp = EXPECTED[name]
    flag = "--ds-config" if name.startswith("ds/") else "--recipe"
    argv = [flag, str(INVALID / name)] + (["--model", exp["model"]] if "model" in exp else [])
    env = {"WORLD_SIZE": str(exp["world_size"])} if "world_size" in exp else {}
    return case(f"invalid:{name}", argv, str(INVALID / name), exp["fragment"], env)


INVALID_CASES = ["ds/gradient_clippping.json", "ds/stage_5.json", "ds/amp_removed.json", "ds/not_utf8.json",
                 "ds/syntax_trailing_comma.json", "ds/nan_gradient_clipping.json", "ds/offload_optimizer_stage0.json",
                 "ds/duplicate_key_top.json", "ds/top_level_array.json", "ds/pipeline_not_dividing.json",
                 "recipes/unknown_key.json", "recipes/nested_unknown_key.json", "recipes/precision_typo.json",
                 "recipes/nvme_without_path.json", "recipes/3d_world_2.json", "recipes/pipeline_zero3.json",
                 "recipes/tp3_tiny_llama_heads.json"]
NO_COMPILER = {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": f"{FIXTURE}/empty_extensions"}

CASES = [
    # command line
    case("cli:unknown_recipe", ["--recipe", "nope"], "unknown recipe 'nope'", "valid recipes:"),
    case("cli:set_without_value", ["--set", "train.steps"], "--set 'train.steps'", "expected KEY=VALUE"),
    case("cli:set_unknown_key", ["--set", "zero.stag=3"], "--set zero.stag", "did you mean 'zero.stage'?"),
    case("cli:set_wrong_type", ["--set", "train.steps=twenty"], "train.steps", "expected integer >= 1"),
    case("cli:set_into_value", ["--set", "zero=1", "--set", "zero.stage=2"], "--set zero.stage",
         "not a block of keys"),
    case("cli:seq_len_below_minimum", ["--set", "train.seq_len=4"], "train.seq_len", "got 4"),
    case("cli:ds_config_missing", ["--ds-config", f"{FIXTURE}/nope.json"], f"{FIXTURE}/nope.json", "no such file"),
    case("cli:resume_latest_without_output_dir", ["--resume"], "--resume latest", "needs --output-dir"),
    # recipes and DeepSpeed JSON, world sizes
    *[from_invalid(name) for name in INVALID_CASES],
    case("recipe:pipeline_world_3", ["--recipe", "pipeline"], "parallel.pipeline",
         "pipeline degree 2 does not divide the world size 3", env={"WORLD_SIZE": "3"}),
    case("recipe:tp_world_3", ["--recipe", "tp"], "parallel.tensor",
         "tensor degree 2 does not divide the world size 3", env={"WORLD_SIZE": "3"}),
    case("recipe:tp_kv_heads", ["--recipe", "tp", "--set", "parallel.tensor=4"], "parallel.tensor",
         "num_key_value_heads (2) of model tiny-llama must be divisible by the tensor degree (4): 2 / 4 = 0.5 per rank",
         env={"WORLD_SIZE": "4"}),
    case("recipe:batch_not_dividing", ["--recipe", "zero1", "--set", "batch.train_batch_size=7",
                                       "--set", "batch.micro_batch_per_gpu=\"auto\""], "batch.train_batch_size",
         "7", env={"WORLD_SIZE": "2"}),
    # this machine's DeepSpeed ops
    case("ops:cpu_adam_without_compiler", ["--recipe", "zero2_offload"],
         "zero.offload_optimizer (-> zero_optimization.offload_optimizer.device)",
         "cpu_adam op is not built yet", env=NO_COMPILER),
    case("ops:cpu_lion_without_compiler", ["--recipe", "zero3_offload", "--set", "optimizer.type=lion"],
         "zero.offload_optimizer", "cpu_lion op is not built yet", env=NO_COMPILER),
    case("ops:ds_json_cpu_offload_without_compiler", ["--ds-config", f"{FIXTURE}/ds_offload.json"],
         "zero_optimization.offload_optimizer.device", "no C++ compiler", env=NO_COMPILER),
    case("ops:shm_comm_without_compiler", ["--recipe", "ddp"], "accelerator (cpu)",
         "builds its deepspeed_shm_comm op when the process group starts", env=NO_COMPILER, needs="cpu_accelerator"),
    case("ops:nvme_without_libaio", ["--recipe", "zero3_nvme", "--set", f"zero.nvme_path={FIXTURE}/nvme", *TINY,
                                     "--output-dir", f"{FIXTURE}/out_nvme"],
         "zero.offload_optimizer (-> zero_optimization.offload_optimizer.device)",
         "apt-get install libaio-dev", needs="no_libaio"),
    # model
    case("model:seq_len_past_llama_positions", ["--set", "train.seq_len=100000"], "train.seq_len",
         "model tiny-llama has 512 positions (max_position_embeddings"),
    case("model:seq_len_past_gpt2_positions", ["--model", "tiny-gpt2", "--set", "train.seq_len=1024"],
         "train.seq_len", "512 positions (n_positions"),
    case("model:local_dir_short_positions", ["--model", f"{FIXTURE}/model_short"], "train.seq_len",
         "has 64 positions"),
    case("model:tokenizer_past_vocab", ["--model", f"{FIXTURE}/model_vocab"], "train.model",
         "the model's vocab_size is 100"),
    case("model:config_not_json", ["--model", f"{FIXTURE}/model_badjson"], f"{FIXTURE}/model_badjson/config.json",
         "not valid JSON"),
    case("model:dir_missing", ["--model", f"{FIXTURE}/no_such_model"], "unknown model", "no config.json"),
    case("model:dir_without_tokenizer", ["--model", f"{FIXTURE}/model_notok"], "train.model",
         "cannot load tokenizer from directory"),
    case("model:hub_id_offline", ["--model", "no-such-org/no-such-model"], "train.model",
         "HF_HUB_OFFLINE=1", env={"HF_HUB_OFFLINE": "1"}),
    # dataset
    case("data:file_missing", ["--dataset", f"{FIXTURE}/nope.jsonl"], "train.dataset", "does not exist"),
    case("data:unsupported_extension", ["--dataset", f"{FIXTURE}/data/notes.xml"], "train.dataset",
         "unsupported data file"),
    case("data:empty_folder", ["--dataset", f"{FIXTURE}/data/empty"], "train.dataset", "has no data files"),
    case("data:mixed_folder", ["--dataset", f"{FIXTURE}/data/mixed"], "train.dataset", "mixes file kinds"),
    # vision-language models (issue 40): images, placeholders, processor, layouts, text-only models
    case("data:vl_image_missing", ["--model", f"{FIXTURE}/vl_qwen", "--dataset", f"{FIXTURE}/vl/missing.jsonl",
                                   "--set", "train.format=chat"], "train.dataset",
         f"{FIXTURE}/vl/missing.jsonl record 2: image {FIXTURE}/vl/img/nope.png does not exist"),
    case("data:vl_parts_vs_placeholders", ["--model", f"{FIXTURE}/vl_qwen", "--dataset", f"{FIXTURE}/vl/extra.jsonl",
                                           "--set", "train.format=chat"], "train.dataset",
         "record 1: 1 image parts but the rendered conversation holds 2 image placeholders"),
    case("model:vl_text_only_processor", ["--model", f"{FIXTURE}/vl_noproc", "--dataset", f"{FIXTURE}/vl/ok.jsonl",
                                          "--set", "train.format=chat"], "train.model",
         "is a vision-language model (qwen2_vl) but its image processor cannot be loaded"),
    case("recipe:vl_lora_targets_nothing", ["--recipe", "lora_zero2", "--model", f"{FIXTURE}/vl_qwen", "--dataset",
                                            f"{FIXTURE}/vl/ok.jsonl", "--set", "train.format=chat", "--set",
                                            'adapter.target_modules=["wq"]'], "vision.lora",
         "vision.lora includes language but no module of the language model ends with adapter.target_modules ['wq']"),
    case("data:images_under_text_model", ["--dataset", f"{FIXTURE}/vl/ok.jsonl", "--set", "train.format=chat"],
         "train.dataset", "record 1 has images but train.model tiny-llama is a text-only model"),
    case("data:vl_video_frame_missing", ["--model", f"{FIXTURE}/vl_qwen", "--dataset", f"{FIXTURE}/vl/video_gone.jsonl",
                                         "--set", "train.format=chat"], "train.dataset",
         f"{FIXTURE}/vl/video_gone.jsonl record 1: video frame {FIXTURE}/vl/img/gone.png does not exist"),
    case("data:vl_video_parts_vs_placeholders", ["--model", f"{FIXTURE}/vl_qwen", "--dataset",
                                                 f"{FIXTURE}/vl/video_extra.jsonl", "--set", "train.format=chat"],
         "train.dataset", "record 1: 1 video parts but the rendered conversation holds 2 video placeholders"),
    case("data:vl_video_under_image_only_family", ["--model", f"{FIXTURE}/vl_llava", "--dataset",
                                                   f"{FIXTURE}/vl/video_ok.jsonl", "--set", "train.format=chat"],
         "train.dataset", "record 1: a video part, but train.model"),
    case("recipe:vl_sequence_parallel", ["--recipe", "zero3", "--model", f"{FIXTURE}/vl_qwen", "--dataset",
                                         f"{FIXTURE}/vl/ok.jsonl", "--set", "train.format=chat", "--set",
                                         "parallel.sequence=2"], "parallel.sequence",
         "sequence parallel degree 2 for a vision-language model (qwen2_vl): Ulysses", env={"WORLD_SIZE": "2"}),
    # paths and free space
    case("path:output_in_proc", ["--output-dir", "/proc/nope"], "--output-dir", "cannot create anything in /proc"),
    case("path:output_is_a_file", ["--output-dir", f"{FIXTURE}/file.txt"], "--output-dir", "is a file"),
    case("path:output_under_a_file", ["--output-dir", f"{FIXTURE}/file.txt/run"], "--output-dir",
         "is a file, so no folder can be made under it"),
    case("path:recipe_output_dir_in_proc", ["--set", "train.output_dir=/proc/runs"], "train.output_dir",
         "cannot create anything in /proc"),
    case("path:nvme_in_proc", ["--recipe", "zero3_nvme", "--set", "zero.nvme_path=/proc/nvme"],
         "zero.nvme_path (-> zero_optimization.offload_", "cannot create anything in /proc"),
    case("path:nvme_under_a_file", ["--ds-config", f"{FIXTURE}/ds_nvme_under_file.json"],
         "zero_optimization.offload_param.nvme_path", "is a file"),
    case("path:no_room_for_a_checkpoint", ["--model", "llama-3.1-405b", "--output-dir", f"{FIXTURE}/big"],
         "--output-dir", "not enough free space: needs one checkpoint (405,853,388,800 params x 14 B"),
    # which rank reports: rank 0, and the first rank of every other node (its machine may be the one at fault)
    case("rank:non_first_rank_is_silent", ["--output-dir", "/proc/nope", "--local_rank=1"], "", "",
         env={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, silent=True),
    case("rank:first_rank_of_another_node_reports", ["--output-dir", "/proc/nope", "--local_rank=0"],
         "error (rank 2): ", "--output-dir: cannot create anything in /proc",
         env={"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}),
    case("path:no_room_for_nvme_swap", ["--recipe", "zero3_nvme", "--model", "llama-3.1-405b", "--set",
                                        f"zero.nvme_path={FIXTURE}/nvme", "--output-dir", f"{FIXTURE}/big"],
         "--output-dir", "+ NVMe swap files ("),
    # resume
    case("resume:earlier_run_without_resume", ["--output-dir", f"{FIXTURE}/run_done"], f"{FIXTURE}/run_done",
         "already holds an earlier run (global_step5)"),
    case("resume:latest_without_checkpoint", ["--output-dir", f"{FIXTURE}/run_empty", "--resume"],
         "--resume latest", "no checkpoint in"),
    case("resume:path_missing", ["--resume", f"{FIXTURE}/run_done/checkpoints/global_step9"],
         f"--resume {FIXTURE}/run_done/checkpoints/global_step9", "no such checkpoint"),
    case("resume:path_outside_a_run", ["--resume", f"{FIXTURE}/data"], f"--resume {FIXTURE}/data",
         "not inside a run folder"),
    case("resume:zero0_bf16_onto_a_pipeline", ["--recipe", "pipeline", "--resume", f"{FIXTURE}/run_zero0/"
                                                "checkpoints/global_step2"],
         f"--resume {FIXTURE}/run_zero0/checkpoints/global_step2", "ZeRO-0; this launch is world 2 with pipeline 2, "
         "tensor 1, ZeRO-1: a layout change with ZeRO-0 goes through the universal checkpoint, which the harness "
         "writes and reads for ZeRO-0 in fp32 without tensor or pipeline parallelism only (the saved side is "
         "pipeline 1, tensor 1, bf16)", env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}),
    # after init, before the engine: only packing tells how much data there is (rank 0 packs once for all)
    case("data:fewer_rows_than_one_global_batch", ["--dataset", f"{FIXTURE}/data/small.jsonl", "--set",
                                                   "train.seq_len=32", *TINY, "--output-dir", f"{FIXTURE}/out_small"],
         "train.dataset", "fewer than one global batch: ", post_init=True),
    case("data:fewer_pairs_than_one_global_batch", ["--set", "train.objective=dpo", "--set",
                                                    "batch.micro_batch_per_gpu=64", *TINY, "--output-dir",
                                                    f"{FIXTURE}/out_pairs"],
         "train.dataset 'builtin'", "training pairs (after holding out eval_fraction=0.02), fewer than one global "
         "batch: 64 micro x 4 accum x 1 dp = 256 pairs", post_init=True),
    case("data:shorter_than_one_block", ["--dataset", f"{FIXTURE}/data/tiny.jsonl", *TINY,
                                         "--output-dir", f"{FIXTURE}/out_tiny"], "the dataset has",
         "fewer than one block of seq_len=128", post_init=True),
    case("data:chat_record_the_template_cannot_render", ["--model", f"{FIXTURE}/model_gemma_chat", "--dataset",
                                                        f"{FIXTURE}/data/chat_tool.jsonl", "--set", "train.format=chat"],
         f"train.dataset: data file {FIXTURE}/data/chat_tool.jsonl line 3 is not a chat record the tokenizer's template "
         "can train", "(TemplateError: Conversation roles must alternate user/assistant/user/assistant/...)"),
    case("data:mixture_record_missing_field", ["--set", "train.datasets=" + MIX.format(
         f'"{FIXTURE}/data/alpaca_bad.jsonl"', "alpaca")], "train.datasets[1].dataset: data file "
         f"{FIXTURE}/data/alpaca_bad.jsonl line 2 is not a valid alpaca record", "has output=None, not text"),
    case("data:mixture_column_missing", ["--set", "train.datasets=" + MIX.format(f'"{FIXTURE}/data/small.jsonl"',
         "instruction")], "train.datasets[1].dataset", "has no column 'prompt' (train.datasets[1].prompt_field"),
    case("data:mixture_store_of_another_tokenizer", ["--set", "train.datasets=" + MIX.format(
         f'"{FIXTURE}/store_other_tokenizer"', "text")], "train.datasets[1].dataset",
         "the store was tokenized with another tokenizer"),
    case("data:text_field_missing", ["--set", "train.text_field=body", *TINY, "--output-dir", f"{FIXTURE}/out_col"],
         "no column 'body'", "fix: set train.text_field to the column", post_init=True),
    # an RL run's prompts (harness/rl/prompts.py) and replay file (harness/rl/replay.py), read after init
    case("data:rl_prompt_column_missing", [*GRPO, "--dataset", f"{FIXTURE}/questions.jsonl", "--set",
                                           'rl.rewards=["harness.rl.toy:vowels"]', "--output-dir", f"{FIXTURE}/out_q"],
         f"{FIXTURE}/questions.jsonl has no column 'prompt' (train.prompt_field, objective 'grpo': TRL's prompt "
         "column)", "fix: set train.prompt_field to the key that holds it"),
    case("data:rl_prompt_too_long_refused", [*GRPO, "--set", "rl.max_prompt_length=4", "--set", "rl.truncation=refuse",
                                             "--output-dir", f"{FIXTURE}/out_long"],
         "record 1's prompt is", "over rl.max_prompt_length 4\n    fix: raise rl.max_prompt_length, or set "
         "rl.truncation=drop", post_init=True),
    case("data:rl_replay_short", [*GRPO, "--set", f"rl.replay={FIXTURE}/replay_short.jsonl", "--output-dir",
                                  f"{FIXTURE}/out_replay"], f"rl.replay {FIXTURE}/replay_short.jsonl",
         "step 1 has 1 completions; the run generates 8 per generation", post_init=True),
]


def write_fixtures(fx: Path) -> None:
    _mixture_fixtures(fx)
    (fx / "file.txt").write_text("not a folder\n")
    (fx / "questions.jsonl").write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    (fx / "replay_short.jsonl").write_text(json.dumps({"step": 1, "prompt_ids": [5, 6], "completion_ids": [7, 0],
                                                       "reward": 1.0}) + "\n")
    (fx / "empty_extensions").mkdir()
    offload = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    (fx / "ds_offload.json").write_text(json.dumps(offload))
    nvme = dict(offload, zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": f"{fx}/file.txt/nvme"}})
    (fx / "ds_nvme_under_file.json").write_text(json.dumps(nvme))
    from harness.model_shapes import PRESETS

    for name, changes in (("model_short", {"max_position_embeddings": 64}), ("model_vocab", {"vocab_size": 100}),
                          ("model_notok", {})):
        folder = fx / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**PRESETS["tiny-llama"], **changes}))
        if name != "model_notok":
            for asset in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(ASSETS / asset, folder / asset)
    _vision_fixtures(fx)
    (fx / "model_badjson").mkdir()
    (fx / "model_badjson" / "config.json").write_text("{\"model_type\": ")
    data = fx / "data"
    (data / "empty").mkdir(parents=True)
    (data / "mixed").mkdir()
    (data / "mixed" / "a.txt").write_text("hello\n")
    (data / "mixed" / "b.csv").write_text("text\nhello\n")
    (data / "notes.xml").write_text("<notes/>\n")
    (data / "tiny.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    words = " ".join(f"word{i}" for i in range(30))  # ~3 blocks of 32 tokens in all: 1 eval + 2 train rows
    (data / "small.jsonl").write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(2)))
    _chat_fixtures(fx)
    step = fx / "run_done" / "checkpoints" / "global_step5"
    step.mkdir(parents=True)
    (step.parent / "latest").write_text("global_step5")
    (fx / "run_empty").mkdir()
    zero0 = fx / "run_zero0" / "checkpoints" / "global_step2"  # saved by 1 rank on ZeRO-0 in bf16
    zero0.mkdir(parents=True)
    (zero0 / "mp_rank_00_model_states.pt").write_bytes(b"")
    (zero0 / "manifest.json").write_text(json.dumps({"step": 2, "world_size": 1, "pp": 1, "tp": 1, "dp": 1,
                                                      "zero_stage": 0, "train_batch_size": 4, "precision": "bf16"}))


def _vision_fixtures(fx: Path) -> None:
    """A tiny Qwen2-VL folder, one without its image processor, and chat files with image parts."""
    from helpers.vl_models import llava_folder, qwen2_vl_folder, write_images

    qwen2_vl_folder(fx / "vl_qwen")
    llava_folder(fx / "vl_llava")
    (fx / "vl_noproc").mkdir()
    for path in (fx / "vl_qwen").iterdir():
        if path.name != "preprocessor_config.json":
            shutil.copy(path, fx / "vl_noproc" / path.name)
    write_images(fx / "vl" / "img", 1)

    def chat(*contents):
        return "".join(json.dumps({"messages": [{"role": "user", "content": c},
                                                {"role": "assistant", "content": "ok"}]}) + "\n" for c in contents)

    image = {"type": "image", "image": "img/img0.png"}
    (fx / "vl" / "ok.jsonl").write_text(chat([image, {"type": "text", "text": "what?"}], "hello"))
    (fx / "vl" / "missing.jsonl").write_text(chat("hello", [{"type": "image", "image": "img/nope.png"}]))
    (fx / "vl" / "extra.jsonl").write_text(chat([image, {"type": "text", "text": "see <|image_pad|>"}]))
    clip = {"type": "video", "video": ["img/img0.png", "img/img0.png"]}
    (fx / "vl" / "video_ok.jsonl").write_text(chat([clip, {"type": "text", "text": "what?"}]))
    (fx / "vl" / "video_gone.jsonl").write_text(chat([{"type": "video", "video": ["img/img0.png", "img/gone.png"]}]))
    (fx / "vl" / "video_extra.jsonl").write_text(chat([clip, {"type": "text", "text": "see <|video_pad|>"}]))


def _chat_fixtures(fx: Path) -> None:
    """A tiny-llama folder whose tokenizer carries Gemma 3's chat template (no tool role), and chat records whose
    line 3 holds a tool result."""
    from helpers.chat_templates import TEMPLATES
    from harness.model.hf import load_tokenizer
    from harness.model_shapes import PRESETS

    folder = fx / "model_gemma_chat"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    tok = load_tokenizer("tiny-llama")
    tok.chat_template = (TEMPLATES / "gemma3.jinja").read_text()
    tok.save_pretrained(folder)
    turn = [{"role": "user", "content": "Sort: b a"}, {"role": "assistant", "content": "a b"}]
    tool = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
            {"role": "tool", "content": "3 C"}, {"role": "assistant", "content": "3 C."}]
    (fx / "data" / "chat_tool.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in (turn, turn, tool)))


def _mixture_fixtures(fx: Path) -> None:
    data = fx / "data"
    data.mkdir(exist_ok=True)
    (data / "alpaca_bad.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" +
                                           json.dumps({"instruction": "c"}) + "\n")
    store = fx / "store_other_tokenizer"  # a prepared token store's files, from another tokenizer
    store.mkdir()
    (store / "tokens.bin").write_bytes(b"\0" * 256)
    key = {"tokenizer_hash": "0" * 64, "seq_len": 128, "format": "text"}
    (store / "meta.json").write_text(json.dumps({"key": key, **key}))


def fill(value: str, fx: Path) -> str:
    return value.replace(FIXTURE, str(fx))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    fx = tmp_path_factory.mktemp("catalogue")
    write_fixtures(fx)
    cases = [{"id": c["id"], "argv": [fill(a, fx) for a in c["argv"]], "env": {k: fill(v, fx) for k, v in c["env"].items()},
              "needs": c["needs"], "post_init": c["post_init"]}
             for c in sorted(CASES, key=lambda c: c["post_init"])]  # post-init cases last (see the driver)
    (fx / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "HF_TOKEN": SECRET}  # no message may ever echo a token
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "drivers" / "catalogue.py"), str(fx / "cases.json"),
                           str(fx / "results.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((fx / "results.json").read_text())
    return {"fx": fx, **out}


def test_catalogue_size_and_kinds():
    assert len(CASES) >= 40 and len({c["id"] for c in CASES}) == len(CASES)
    kinds = {c["id"].split(":")[0] for c in CASES}
    assert kinds == {"cli", "invalid", "recipe", "ops", "model", "data", "path", "rank", "resume"}


@pytest.mark.parametrize("c", CASES, ids=[c["id"] for c in CASES])
def test_bad_input_exits_2_naming_the_field(c, results):
    if c["needs"] == "no_libaio" and results["async_io_loads"]:
        pytest.skip("libaio is installed here: the async_io op loads")
    if c["needs"] == "cpu_accelerator" and results["accelerator"] != "cpu":
        pytest.skip("DeepSpeed does not run on its CPU accelerator here")
    fx = results["fx"]
    got = results[c["id"]]
    err = got["stderr"]
    assert got["rc"] == 2, f"exit {got['rc']}\n{err[-3000:]}\n{got['stdout'][-2000:]}"
    if c["silent"]:
        assert "error" not in err and "Traceback" not in err, err
        return
    assert "Traceback" not in err + got["stdout"], err
    assert SECRET not in err + got["stdout"]
    assert [line[:5] for line in err.splitlines()].count("error") == 1, err  # one report, every problem in it
    assert fill(c["where"], fx) in err, err
    assert fill(c["fragment"], fx) in err, err
    if not c["post_init"]:
        assert "Initializing TorchBackend" not in err + got["stdout"], "no process group for bad input"


def test_too_few_pairs_exit_before_the_reference_pass(results):
    """The global-batch check runs before a precomputed reference's pass over the whole preference set."""
    got = results["data:fewer_pairs_than_one_global_batch"]
    assert got["rc"] == 2 and "[pref]" not in got["stdout"] + got["stderr"], got["stdout"][-2000:]
