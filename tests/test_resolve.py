"""harness.config.resolve: "auto" filled from the run settings, world size and model shape, with a source for each."""
import pytest

from harness.model_shapes import KNOWN, PRESETS, shape_summary
from harness.config.recipes import complete
from harness.config.resolve import Context, batch_world, degrees, resolve
from harness.config.rules import check


def recipe(**parts) -> dict:
    return complete({"description": "test", **parts}, "test")


def ctx(world=8, model="tiny-llama", **parts) -> Context:
    shape = shape_summary(PRESETS.get(model) or KNOWN[model]) if model else None
    return Context(recipe=recipe(**parts), world_size=world, model=shape, model_name=model or "")


def batch(ds: dict) -> tuple:
    return ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]


# --- the world size DeepSpeed's batch assertion uses ---

@pytest.mark.parametrize("world,pp,tp,dp", [(8, 1, 1, 8), (8, 2, 1, 4), (8, 2, 2, 2), (16, 4, 2, 2),
                                            (8, 1, 2, 4), (8, 1, 4, 2)])
def test_batch_world(world, pp, tp, dp):
    assert batch_world(world, pp, tp)[0] == dp
    if pp == 1 and tp > 1:  # DeepSpeed's AutoTP (a DeepSpeed dict's autotp_size): the FULL world
        assert batch_world(world, pp, tp, auto_tp=True)[0] == world


def test_batch_world_explains_the_autotp_quirk():
    assert "AutoTP: DeepSpeed counts the 2 tensor ranks" in batch_world(8, 1, 2, auto_tp=True)[1]
    assert batch_world(8, 1, 2)[1] == "world 8 / tensor 2"
    assert batch_world(8, 2, 2)[1] == "world 8 / (pipeline 2 x tensor 2)"


def test_degrees_come_from_the_recipe_else_the_deepspeed_dict():
    r = recipe()
    assert degrees({}, r) == (1, 1)
    assert degrees({"pipeline": {"stages": 4}, "tensor_parallel": {"autotp_size": 2}}, r) == (4, 2)
    assert degrees({"pipeline": {"stages": "auto"}}, r) == (1, 1)
    assert degrees({}, recipe(parallel={"pipeline": 2, "tensor": 2})) == (2, 2)


@pytest.mark.parametrize("bad", [0, -2, True, "2", 1.5, None])
def test_degrees_ignore_values_that_are_not_degrees(bad):
    """The schema reports them; as degrees they would divide by zero (a traceback, not a message)."""
    assert degrees({"pipeline": {"stages": bad}, "tensor_parallel": {"autotp_size": bad}}, recipe()) == (1, 1)


# --- batch arithmetic ---

@pytest.mark.parametrize("given,world,parts,expected", [
    # train_batch_size from micro x accum x dp
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 8, {},
     (48, 2, 3)),
    # micro from batch / (accum x dp)
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}, 8, {},
     (256, 8, 4)),
    # accum from batch / (micro x dp)
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}, 8, {},
     (64, 2, 4)),
    # all auto: micro and accum from the recipe, batch derived
    ({k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}, 8,
     {"batch": {"micro_batch_per_gpu": 2, "grad_accum_steps": 2}}, (32, 2, 2)),
    # absent keys follow DeepSpeed's rule: only train_batch_size -> accumulation 1, micro = batch / world ...
    ({"train_batch_size": 64}, 8, {}, (64, 8, 1)),
    # ... only the micro batch -> accumulation 1 ...
    ({"train_micro_batch_size_per_gpu": 2}, 4, {}, (8, 2, 1)),
    # ... batch and micro -> accumulation derived (not the recipe's micro batch)
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 16}, 8, {}, (256, 16, 2)),
    # an "auto" train_batch_size is the HF Trainer's: its micro batch and accumulation (the recipe's here)
    ({"train_batch_size": "auto"}, 2, {}, (8, 4, 1)),
    # pipeline: dp = world / pp
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
      "pipeline": {"stages": 2}}, 8, {}, (64, 4, 4)),
    # 3D from the recipe: dp = world / (pp x tp)
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 8,
     {"parallel": {"pipeline": 2, "tensor": 2}}, (32, 4, 4)),
    # AutoTP: DeepSpeed counts the tensor ranks, so the batch is over the FULL world
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "tensor_parallel": {"autotp_size": 2}}, 8, {}, (32, 4, 1)),
    # the recipe's parallel.tensor (the harness's layers, with an mpu): dp = world / tp
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1}, 8,
     {"parallel": {"tensor": 2}}, (64, 16, 1)),
])
def test_batch_resolution(given, world, parts, expected):
    ds, _, problems = resolve(given, ctx(world, **parts))
    assert problems == []
    assert batch(ds) == expected
    assert check(ds, ctx(world, **parts)) == [], "a resolved batch passes the batch rule"


def test_batch_provenance_shows_the_arithmetic():
    given = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}
    _, prov, _ = resolve(given, ctx(8))
    assert prov == {"train_micro_batch_size_per_gpu": {"value": 8, "source": "batch 256 / (accum 4 x world 8)"}}
    _, prov, _ = resolve({"train_batch_size": "auto"}, ctx(8, parallel={"pipeline": 2, "tensor": 2}))
    assert prov["train_micro_batch_size_per_gpu"] == {"value": 4, "source": "recipe batch.micro_batch_per_gpu"}
    assert prov["gradient_accumulation_steps"] == {"value": 1, "source": "recipe batch.grad_accum_steps"}
    assert prov["train_batch_size"] == {"value": 8, "source": "micro 4 x accum 1 x world 8 / (pipeline 2 x tensor 2)"}
    _, prov, _ = resolve({"train_batch_size": "auto", "tensor_parallel": {"autotp_size": 2}}, ctx(8))
    assert "AutoTP" in prov["train_batch_size"]["source"]


def test_batch_not_divisible_is_a_problem_not_a_rounding():
    given = {"train_batch_size": 100, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}
    ds, prov, problems = resolve(given, ctx(8))
    assert [p.path for p in problems] == ["train_batch_size"]
    assert "train_batch_size 100 is not divisible by accum 4 x world 8 = 32" in problems[0].message
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and prov == {}
    given = {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    assert "not divisible by micro 4 x world 8 = 32" in resolve(given, ctx(8))[2][0].message


def test_batch_with_one_number_cannot_be_resolved():
    given = {k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    _, _, problems = resolve(given, ctx(8, batch={"micro_batch_per_gpu": "auto", "grad_accum_steps": "auto"}))
    assert [p.path for p in problems] == ["train_batch_size"]
    assert "cannot resolve the batch" in problems[0].message


def test_without_a_world_size_batch_autos_stay():
    given = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    ds, prov, problems = resolve(given, ctx(None))
    assert (ds["train_batch_size"], prov, problems) == ("auto", {}, [])


@pytest.mark.parametrize("bad", ["32", 0, -8, True, [32]])
def test_a_malformed_batch_value_is_never_replaced(bad):
    """Filling around a bad value would hide it from the schema (it used to be overwritten silently)."""
    given = {"train_batch_size": bad, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    ds, prov, problems = resolve(given, ctx(8))
    assert ds["train_batch_size"] == bad and prov == {} and problems == []


def test_accumulation_zero_is_not_a_division_by_zero():
    ds, _, problems = resolve({"train_batch_size": 32, "gradient_accumulation_steps": 0}, ctx(8))
    assert problems == [] and ds["gradient_accumulation_steps"] == 0  # the schema reports it


def test_integral_float_batch_is_a_number_and_is_checked():
    given = {"train_batch_size": 64.0, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    ds, prov, _ = resolve(given, ctx(8))
    assert ds["train_batch_size"] == 64.0 and prov == {}
    assert [p.message for p in check(ds, ctx(8))] == ["train_batch_size 64.0 != micro 4 x accum 1 x world 8 = 32"]


def test_input_is_not_mutated():
    given = {"train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    resolve(given, ctx(8))
    assert given == {"train_batch_size": "auto", "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}


# --- run settings ---

def test_settings_come_from_the_recipe_with_their_source():
    given = {"gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
             "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
             "scheduler": {"type": "WarmupDecayLR", "params": {
                 k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}}}
    c = ctx(None, precision="fp32", gradient_clipping=0.5, optimizer={"lr": 1e-3, "betas": [0.8, 0.9]},
            scheduler={"warmup_steps": 7}, train={"steps": 70})
    ds, prov, problems = resolve(given, c)
    assert problems == []
    assert {k: (v["value"], v["source"]) for k, v in prov.items()} == {
        "gradient_clipping": (0.5, "recipe gradient_clipping"),
        "optimizer.params.lr": (1e-3, "recipe optimizer.lr"),
        "optimizer.params.betas": ([0.8, 0.9], "recipe optimizer.betas"),
        "optimizer.params.eps": (1e-8, "recipe optimizer.eps"),
        "optimizer.params.weight_decay": (0.01, "recipe optimizer.weight_decay"),
        "scheduler.params.warmup_min_lr": (0.0, "default 0"),
        "scheduler.params.warmup_max_lr": (1e-3, "recipe optimizer.lr"),
        "scheduler.params.warmup_num_steps": (7, "recipe scheduler.warmup_steps"),
        "scheduler.params.total_num_steps": (71, "recipe train.steps + 1"),
        "fp16.enabled": (False, "recipe precision 'fp32'"),
        "bf16.enabled": (False, "recipe precision 'fp32'"),
    }
    assert ds["optimizer"]["params"]["betas"] == [0.8, 0.9]


def test_values_that_are_not_auto_are_kept():
    given = {"gradient_clipping": 2.0, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    ds, prov, _ = resolve(given, ctx(None))
    assert ds == given and prov == {}


# --- buckets from the model ---

BUCKETS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


@pytest.mark.parametrize("model,hidden", [("tiny-llama", 64), ("llama-2-7b", 4096), ("gpt2", 768)])
def test_bucket_autos_from_hidden_size(model, hidden):
    given = {"zero_optimization": {"stage": 3, **{k: "auto" for k in BUCKETS}}}
    ds, prov, problems = resolve(given, ctx(None, model=model))
    assert problems == []
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden
    assert prov["zero_optimization.reduce_bucket_size"]["source"] == (
        f"model {model} hidden_size={hidden}: hidden_size^2")
    assert prov["zero_optimization.stage3_param_persistence_threshold"]["source"].endswith("10 x hidden_size")


def test_bucket_auto_without_a_model_is_left_for_launch_with_a_note():
    """The HF integration fills them from the model at launch: without one, nothing to refuse, but say so."""
    given = {"zero_optimization": {"stage": 3, **{k: "auto" for k in BUCKETS}}}
    ds, prov, problems = resolve(given, ctx(None, model=None))
    assert prov == {} and all(ds["zero_optimization"][k] == "auto" for k in BUCKETS)
    assert [p.path for p in problems] == [f"zero_optimization.{k}" for k in BUCKETS]
    assert all(p.severity == "note" and "hidden_size" in p.message and "--model" in p.fix for p in problems)


def test_no_batch_size_at_all_is_refused_as_deepspeed_does():
    for given in ({}, {"gradient_accumulation_steps": 4}):
        _, _, problems = resolve(given, ctx(8))
        assert [(p.path, p.severity) for p in problems] == [("train_batch_size", "error")], given
        assert "DeepSpeed needs train_batch_size or train_micro_batch_size_per_gpu" in problems[0].message


def test_only_train_batch_size_smaller_than_the_world_is_refused():
    """DeepSpeed: micro = 2 // 8 = 0, "Micro batch size per gpu: 0 has to be greater than 0"."""
    _, prov, problems = resolve({"train_batch_size": 2}, ctx(8))
    assert prov["gradient_accumulation_steps"]["source"] == "DeepSpeed's default when only one batch size is given"
    assert [p.path for p in problems] == ["train_batch_size"]
    assert "not divisible by accum 1 x world 8 = 8" in problems[0].message


def test_sequence_parallel_size_divides_the_batch_world():
    given = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "sequence_parallel_size": 2}
    assert check(resolve(given, ctx(4))[0], ctx(4)) == []
    problems = check(resolve(given, ctx(8))[0], ctx(8))
    assert [p.path for p in problems] == ["train_batch_size"]
    assert "world 8 / sequence_parallel_size 2" in problems[0].message


def test_model_shape_of_an_unknown_hub_id_is_unknown_not_an_error():
    from harness.commands.common import model_shape

    assert model_shape("acme/not-a-known-model") is None
    assert model_shape("tiny-llama")["hidden_size"] == 64
