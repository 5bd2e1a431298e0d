"""harness/model/attention.py: which attention a run uses under each packing, what its document mask costs,
and the refusals (exit 2 before any rank starts) for a combination that would drop the mask or materialise one
past the bound."""

import os
import subprocess
import sys

from harness.model import attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASH = frozenset({"flash_attention_2"})


def test_gpu_default_keeps_documents_without_an_s2_mask():
    flash = attention.choose("cuda", "document", 32768, 1, installed=FLASH)
    assert (flash.implementation, flash.mask_bytes, flash.materialised) == ("flash_attention_2", 0, False)
    flex = attention.choose("cuda", "document", 32768, 1, installed=frozenset())
    assert flex.implementation == "flex_attention" and flex.mask_bytes == 1 * 256 * 256 * 8 and not flex.materialised
    # flash keeps documents only at micro-batch 1: the default moves to flex rather than drop the mask
    assert attention.choose("cuda", "document", 4096, 2, installed=FLASH).implementation == "flex_attention"
    assert attention.choose("cuda", "concat", 4096, 2, installed=FLASH).implementation == "flash_attention_2"
    assert attention.choose("cuda", "concat", 4096, 2, installed=frozenset()).implementation == "sdpa"


def test_cpu_default_is_sdpa_with_its_mask_bytes():
    choice = attention.choose("cpu", "document", 4096, 2, installed=FLASH)
    assert choice.implementation == "sdpa" and choice.materialised and choice.mask_bytes == 2 * 4096 * 4096
    assert attention.choose("cpu", "concat", 4096, 2).mask_bytes == 0
    eager = attention.choose("cpu", "document", 1024, 1, requested="eager", itemsize=2)
    assert eager.mask_bytes == 1024 * 1024 * 2
    assert attention.problems(choice, "cpu", "document", 4096, 2) == []  # 32 MiB: under the bound, no GPU warning


def _messages(choice, device, packing, seq_len, micro, installed=FLASH):
    return [(p.severity, p.message, p.fix) for p in attention.problems(choice, device, packing, seq_len, micro,
                                                                       installed=installed)]


def test_refusals_name_the_bytes_and_the_fix():
    big = attention.choose("cpu", "document", 40000, 1)
    [(severity, message, fix)] = _messages(big, "cpu", "document", 40000, 1)
    assert severity == "error" and "1 x 40000^2 x 1 byte = 1600000000 bytes, 1.490 GiB), past the 1.000 GiB" in message
    assert "flash-attention" in fix and "train.packing=concat" in fix
    dropped = attention.choose("cuda", "document", 4096, 4, installed=FLASH, requested="flash_attention_2")
    [(severity, message, fix)] = _messages(dropped, "cuda", "document", 4096, 4)
    assert severity == "error" and "only at micro-batch 1" in message and "micro_batch_per_gpu=1" in fix
    assert _messages(dropped, "cuda", "concat", 4096, 4) == []
    flex_cpu = attention.choose("cpu", "document", 512, 1, requested="flex_attention")
    assert "no backward on CPU" in _messages(flex_cpu, "cpu", "document", 512, 1)[0][1]
    flash_cpu = attention.choose("cpu", "concat", 512, 1, requested="flash_attention_2")
    assert "needs a CUDA GPU" in _messages(flash_cpu, "cpu", "concat", 512, 1)[0][1]
    missing = attention.choose("cuda", "concat", 512, 1, requested="flash_attention_2", installed=frozenset())
    assert "not installed" in _messages(missing, "cuda", "concat", 512, 1, installed=frozenset())[0][1]
    last_resort = attention.choose("cuda", "document", 8192, 1, requested="sdpa")
    [(severity, message, _)] = _messages(last_resort, "cuda", "document", 8192, 1)
    assert severity == "warning" and "67108864 bytes" in message  # 8192^2: named, not refused


def test_launch_refuses_an_s2_mask_past_the_bound_before_ranks_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1", PYTHONPATH=ROOT)
    argv = ["--recipe", "zero2_offload", "--set", "train.seq_len=512", "--set", "batch.micro_batch_per_gpu=4100",
            "--set", "batch.train_batch_size=auto", "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run([sys.executable, "harness/run.py", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("train.packing: sdpa under document packing materialises a [4100, 1, 512, 512] mask (4100 x 512^2 x 1 "
            "byte = 1074790400 bytes, 1.001 GiB), past the 1.000 GiB bound") in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_gemma3_image_blocks_never_get_flash_under_document_packing():
    """Gemma 3's two-way image blocks (harness/model/vision_masks.py) need a mask function: under document packing
    the default skips flash (flex on a GPU, sdpa on CPU, two masks: full and sliding layers), a requested flash is
    refused with the reason; concat keeps flash (one conversation per row: transformers' own masks)."""
    assert attention.has_image_blocks({"model_type": "gemma3"})
    assert not attention.has_image_blocks({"model_type": "llava"}) and not attention.has_image_blocks({})
    gpu = attention.choose("cuda", "document", 4096, 1, installed=FLASH, image_blocks=True)
    assert gpu.implementation == "flex_attention" and "image blocks" in gpu.why and gpu.masks == 2
    cpu = attention.choose("cpu", "document", 1024, 2, image_blocks=True)
    assert cpu.implementation == "sdpa" and cpu.mask_bytes == 2 * 2 * 1024 * 1024
    assert attention.choose("cuda", "concat", 4096, 1, installed=FLASH, image_blocks=True).implementation \
        == "flash_attention_2"
    asked = attention.choose("cuda", "document", 4096, 1, installed=FLASH, requested="flash_attention_2",
                             image_blocks=True)
    found = attention.problems(asked, "cuda", "document", 4096, 1, installed=FLASH, image_blocks=True)
    assert len(found) == 1 and "two-way attention" in found[0].message and "flex_attention" in found[0].fix
    assert attention.problems(asked, "cuda", "document", 4096, 1, installed=FLASH) == []  # a text model: fine
    assert "x 2 masks (Gemma 3's full and sliding layers)" in attention.problems(
        cpu, "cuda", "document", 1024, 2, installed=FLASH)[0].message  # the GPU warning names both masks
