"""The data and the step of a vision-language run (a model with a vision_config; docs/vision-language.md).

Data: chat records with images, preprocessed once into the vision store (harness/data/vision_store.py), whole
conversations packed into rows (harness/data/vision_pack.py), each row's images with it in span order. Step: before a step's micro-batches run, the ranks agree on how many vision-tower calls each
micro-batch makes (the most any rank needs: ceil(images / vision.max_images_per_call), at least 1) in ONE small
all-reduce; then every rank makes exactly that many calls per micro-batch (harness/model/vision.py: a rank short of
images calls the tower on a placeholder that adds exactly zero). ZeRO-3's gathers and ZeRO-1/2's gradient
reductions then run the same sequence on every rank, whatever each rank's rows hold. The loss is the mean over this
rank's assistant tokens per micro-batch (num_items_in_batch, as the LM step); DeepSpeed averages over
micro-batches and ranks.
"""

from __future__ import annotations

import torch

from harness.data.rows import loss_items


def is_vision_run(spec) -> bool:
    """The run trains a vision-language model (its config, read once by the session, has a vision_config)."""
    return bool((spec.model_config or {}).get("vision_config"))


def image_processor(spec):
    """The image processor saved with every checkpoint and export (None for a text-only model)."""
    if not is_vision_run(spec):
        return None
    from harness.model.hf import load_model_config
    from harness.model.vision import load_image_processor

    name = spec.recipe["train"]["model"]
    return load_image_processor(name, load_model_config(name))


def load_data(spec, dist, tokenizer):
    """(train, eval, start-up lines): the vision store for the run's data, prepared once per node."""
    import time

    from harness.data.corpus import DataSpec
    from harness.data.formats import check_chat_template
    from harness.data.rows import split_rows
    from harness.data.video import defaults_of as video_defaults
    from harness.data.vision_store import Context, VisionRows, ensure
    from harness.errors import UsageError
    from harness.model.hf import load_model_config
    from harness.model.vision import family_of, image_token_id, load_image_processor

    start, train = time.perf_counter(), spec.recipe["train"]
    config = load_model_config(train["model"])
    data_spec = DataSpec.from_train(train)
    if data_spec.format != "chat":
        raise UsageError(f"train.model {train['model']} is a vision-language model but train.format is "
                         f"{data_spec.format!r}\n    fix: train.format=chat with messages whose content parts hold "
                         'the images ({"type": "image", "image": "cat.png"}); text-only records mix in freely')
    check_chat_template(tokenizer, train["model"], "chat")
    token = image_token_id(config)
    if token is None or token >= len(tokenizer):
        raise UsageError(f"the tokenizer of {train['model']} ({len(tokenizer)} tokens) has no image token "
                         f"(config image_token_id {token})\n    fix: save the model's own processor/tokenizer in the "
                         "folder; a text-only tokenizer cannot mark where the images go")
    ctx = Context(tokenizer, load_image_processor(train["model"], config), config, family_of(config).grid, token,
                  data_spec.messages_field, None, data_spec.dataset, video_defaults(train["model"]))
    store, made = ensure(data_spec, ctx, train["seq_len"], train["store_dir"] or None, dist.local_rank)
    rows, meta = VisionRows.of(store, train["packing"]), store["meta"]
    train_rows, eval_rows = split_rows(rows, train["eval_fraction"], train["seed"])
    kept = ("attention and positions per conversation" if train["packing"] == "document" else
            "conversations attend to the ones before them in a row")
    videos = f", {meta['videos']} videos" if meta["videos"] else ""
    lines = [f"{'prepared' if made else 'using'} vision store {store['path']}: {meta['conversations']} conversations "
             f"({meta['with_images']} with images, {meta['images'] - meta['videos']} images{videos}, "
             f"{meta['pixel_bytes'] / 2**20:.2f} MiB of pixels) packed whole into {meta['rows']} rows of "
             f"{train['seq_len']} (train.packing={train['packing']}: {kept}); {meta['truncated']} truncated at seq_len; "
             f"data ready in {time.perf_counter() - start:.2f}s"]
    return train_rows, eval_rows, lines


def with_vision_load(spec, rows):
    """spec with its run's vision load (planner/vision.run_load): the train rows' worst row, by pixel elements, so
    the planner's per-rank prediction counts the vision tower's and projector's activations."""
    import dataclasses

    import numpy as np

    from harness.planner.vision import run_load

    store, index = rows.arrays, np.asarray(rows.index)
    starts, offsets = np.asarray(store["row_images"]), np.asarray(store["pixel_offsets"])
    images, pixels = starts[index + 1] - starts[index], offsets[starts[index + 1]] - offsets[starts[index]]
    worst = int(np.argmax(pixels)) if len(index) else 0
    vision = spec.recipe["vision"]
    load = run_load(dict(spec.model_config), int(images[worst]) if len(index) else 0,
                    int(pixels[worst]) if len(index) else 0, tuple(vision["freeze"]), vision["max_images_per_call"])
    return dataclasses.replace(spec, run=dataclasses.replace(spec.run, vision=load))


def agreed_calls(engine, batches: list, per_call: int) -> list[int]:
    """Vision-tower calls per micro-batch: the most any rank needs at that micro-batch (one all-reduce, MAX)."""
    import torch.distributed as dist

    from harness.model.vision import num_chunks

    need = torch.tensor([num_chunks(b[2], per_call) for b in batches], dtype=torch.int64, device=engine.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
    return need.cpu().tolist()


class VisionSteps:
    def __init__(self, spec):
        self.per_call = spec.recipe["vision"]["max_images_per_call"]

    def forward(self, engine, batch, calls: int):
        input_ids, labels, images, *positions = batch  # position ids under train.packing=document
        positions = positions[0].to(engine.device) if positions else None
        return engine(input_ids=input_ids.to(engine.device), labels=labels.to(engine.device), images=images,
                      num_calls=calls, per_call=self.per_call, position_ids=positions, use_cache=False,
                      num_items_in_batch=loss_items(labels))

    def train(self, engine, batches: list) -> torch.Tensor:
        total = None
        for batch, calls in zip(batches, agreed_calls(engine, batches, self.per_call)):
            out = self.forward(engine, batch, calls)
            engine.backward(out.loss)
            engine.step()
            total = out.loss.detach().float() if total is None else total + out.loss.detach().float()
        return total / len(batches)

    @torch.no_grad()
    def eval(self, engine, batches: list) -> float:
        losses = [self.forward(engine, b, c).loss.float().item()
                  for b, c in zip(batches, agreed_calls(engine, batches, self.per_call))]
        return sum(losses) / len(losses)
