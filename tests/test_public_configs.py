"""`harness validate` agrees with DeepSpeed 0.19.8 (+ the HF Trainer / accelerate "auto" fill) on the patterns found in
configs that public projects ship (tests/public_configs.md). Ground truth is DeepSpeed itself: DeepSpeedConfig at
world 4 and 8 and, for configs that name an optimizer, an engine built on a tiny Llama in this process (one gloo
rank); see tests/helpers/deepspeed_verdict.py."""
import json
import re
from pathlib import Path

import pytest

from helpers import deepspeed_verdict as truth

HERE = Path(__file__).parent
TABLE = (HERE / "public_configs.md").read_text()
FIXTURES = HERE / "fixtures" / "ds_configs"


def table(title: str) -> list[list[str]]:
    section = TABLE.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows[1:]]  # without the header (the |---| line is not "| ")


PATTERNS = {row[0]: row for row in table("Patterns")}
# rows refused at other world sizes than their pattern's fixture (same pattern, other numbers)
ROW_DIFFERS = {"benchmarks/autosp/configs/autosp_config.json": "train_batch_size 1 where the fixture has 2: "
               "with sequence_parallel_size 2 it is refused at world 4 too"}
CORPUS = table("Corpus")


def test_corpus_has_40_configs_from_6_projects_and_every_pattern_has_a_fixture():
    assert len(CORPUS) >= 40 and len({row[0] for row in CORPUS}) >= 6
    assert re.search(rf"## Corpus \({len(CORPUS)} configs, {len({r[0] for r in CORPUS})} projects\)", TABLE)
    assert {row[3] for row in CORPUS} <= set(PATTERNS)
    assert {p.stem for p in FIXTURES.glob("*.json")} == set(PATTERNS)
    for project, path, commit, pattern, ds, harness in CORPUS:
        assert re.fullmatch(r"[0-9a-f]{10}", commit) and path.endswith(".json"), (project, path)
        same = [truth.refused_worlds(c) for c in (ds, harness)] == [truth.refused_worlds(c) for c in PATTERNS[pattern][2:]]
        assert same or path in ROW_DIFFERS, (path, pattern)


@pytest.mark.parametrize("row", CORPUS, ids=[row[1] for row in CORPUS])
def test_harness_refuses_exactly_where_deepspeed_does(row):
    """On every public config: accepted by both (warnings allowed), or refused by both at the same world sizes."""
    assert truth.refused_worlds(row[4]) == truth.refused_worlds(row[5]), row


@pytest.fixture(scope="module")
def gloo():
    with truth.gloo_world_of_one():
        yield


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_verdicts_are_deepspeeds(name, gloo):
    """The fixture of each pattern, run through DeepSpeed (+ auto fill) and through `harness validate`, gives the
    verdicts the table records, and the two agree."""
    path = FIXTURES / f"{name}.json"
    _, _, want_ds, want_harness = PATTERNS[name]
    got_ds = truth.deepspeed_cell(json.loads(path.read_text()))
    got_harness = truth.harness_cell(str(path))
    assert (got_ds, got_harness) == (want_ds, want_harness)
    assert truth.refused_worlds(got_ds) == truth.refused_worlds(got_harness)


def test_accelerate_fill_is_read_from_accelerate():
    """What accelerate fills for "auto" comes from its own source, and the schema marks those keys fillable."""
    from harness.config.schema import DS_SCHEMA, subschema
    fills = truth.accelerate_fills()
    assert fills["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is False
    for key in fills:
        assert subschema(DS_SCHEMA, key).get("x-auto"), key
