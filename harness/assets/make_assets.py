"""Regenerate the built-in corpus and tokenizer: `python harness/assets/make_assets.py`.

Why this exists: the tiny presets must train for real with no network, and a reviewer must be able to
see where every shipped byte came from. Everything here is synthetic (no copyrighted text) and
deterministic (fixed seeds; `tokenizers` BPE training is deterministic for a fixed input), so rerunning
reproduces `corpus.jsonl`, `preference.jsonl` and `tokenizer.json` byte for byte.

The corpus mixes document kinds with learnable structure at several levels: a fixed fact table
(memorisable), ordered sequences (days, months, counting), correct arithmetic, templated stories that
repeat their character names (copying), dialogue and recipes. A 2-layer, 64-wide model's loss falls
from ln(512) ~ 6.2 to well under 4 within ~100 steps on it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
CORPUS_FILE = "corpus.jsonl"
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 512  # == harness.model_shapes.TINY_VOCAB_SIZE (not imported: this script stands alone)
SEED = 20261130
TARGET_BYTES = 2_000_000

NAMES = ["Alice", "Bob", "Carol", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo",
         "Mia", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yara", "Zoe"]
ADJS = ["small", "big", "old", "new", "red", "blue", "green", "quiet", "happy", "tired", "bright", "dark",
        "warm", "cold", "soft", "loud", "kind", "brave", "clever", "busy", "calm", "round", "tall", "short"]
PLACES = ["village", "city", "forest", "house", "garden", "school", "market", "farm", "library", "harbor",
          "park", "kitchen", "station", "valley", "island", "castle"]
OBJECTS = ["ball", "book", "cup", "key", "hat", "box", "lamp", "map", "coin", "kite", "letter", "bell",
           "basket", "shoe", "clock", "stone", "ring", "drum"]
LANDMARKS = ["river", "bridge", "old tree", "big rock", "well", "gate", "hill", "pond", "tower", "fence"]
TIMES = ["morning", "evening", "afternoon", "night", "weekend", "summer", "winter", "spring"]
HABITS = ["walked to the {place}", "read a book", "fed the birds", "cooked soup", "played music",
          "cleaned the {place}", "wrote a letter", "sang a song", "visited a friend", "worked in the garden"]
FEELINGS = ["happy", "surprised", "curious", "glad", "proud", "calm", "excited", "thankful"]
# A fixed fact table: the same facts recur throughout, so a small model can memorise them.
ANIMALS = {
    "cat": ("four", "fish", "meows", "house"), "dog": ("four", "meat", "barks", "house"),
    "cow": ("four", "grass", "moos", "farm"), "duck": ("two", "bread", "quacks", "pond"),
    "horse": ("four", "hay", "neighs", "farm"), "owl": ("two", "mice", "hoots", "forest"),
    "frog": ("four", "flies", "croaks", "pond"), "sheep": ("four", "grass", "bleats", "farm"),
    "bee": ("six", "nectar", "buzzes", "garden"), "lion": ("four", "meat", "roars", "savanna"),
    "hen": ("two", "seeds", "clucks", "farm"), "bear": ("four", "honey", "growls", "forest"),
}
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow",
          "blood": "red", "orange": "orange", "lemon": "yellow", "leaf": "green", "night": "dark"}
FOODS = ["bread", "milk", "eggs", "apples", "rice", "cheese", "tea", "soup", "beans", "carrots", "onions",
         "butter", "honey", "pears", "potatoes", "salt", "flour", "sugar", "tomatoes", "fish"]
DISHES = ["soup", "bread", "pie", "salad", "stew", "cake", "porridge", "pancakes"]
STEPS = ["wash the {f}", "cut the {f}", "mix the {f} with the {g}", "boil the {f}", "add the {f}",
         "stir the pot", "bake it for {n} minutes", "let it cool", "serve it warm"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
                "nineteen", "twenty"]
WEATHER = ["sunny", "rainy", "cloudy", "windy", "snowy", "foggy"]


def _a(word: str) -> str:
    """English article, so the text stays grammatical ("an owl", "a cat")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def _story(r: random.Random) -> str:
    """A short tale that keeps reusing its hero's name and place: rewards copying from context."""
    name, place, obj = r.choice(NAMES), r.choice(PLACES), r.choice(OBJECTS)
    friend = r.choice([n for n in NAMES if n != name])
    pron = r.choice(["he", "she"])
    out = [f"Once upon a time, {name} lived in {_a(r.choice(ADJS))} {place}.",
           f"Every {r.choice(TIMES)}, {name} {r.choice(HABITS).format(place=place)}."]
    out.append(f"One day, {name} found {_a(r.choice(ADJS))} {obj} near the {r.choice(LANDMARKS)}.")
    for _ in range(r.randint(1, 4)):
        out.append(r.choice([
            f"{name} showed the {obj} to {friend}.",
            f"{friend} said, \"What {_a(r.choice(ADJS))} {obj}!\"",
            f"Then {pron} {r.choice(HABITS).format(place=place)}.",
            f"{name} felt {r.choice(FEELINGS)}.",
            f"The {obj} was {r.choice(ADJS)} and {r.choice(ADJS)}.",
            f"{name} and {friend} went to the {r.choice(PLACES)} together.",
        ]))
    out.append(f"In the end, {name} kept the {obj} in the {place}, and {pron} was {r.choice(FEELINGS)}.")
    return " ".join(out)


def _facts(r: random.Random) -> str:
    """Statements from the fixed fact table: the same truths everywhere, so they can be memorised."""
    out = []
    for animal in r.sample(sorted(ANIMALS), r.randint(3, 6)):
        legs, food, sound, home = ANIMALS[animal]
        art = _a(animal).capitalize()
        out.append(r.choice([
            f"{art} has {legs} legs.", f"{art} eats {food}.", f"{art} {sound}.",
            f"{art} lives on the {home}." if home == "farm" else f"{art} lives in the {home}.",
            f"The {animal} has {legs} legs, eats {food} and {sound}.",
        ]))
    for thing in r.sample(sorted(COLORS), r.randint(1, 3)):
        out.append(f"The {thing} is {COLORS[thing]}.")
    return " ".join(out)


def _arithmetic(r: random.Random) -> str:
    """Correct sums, differences and products with small numbers, in digits and in words."""
    out = ["Math practice."]
    for _ in range(r.randint(4, 10)):
        a, b = r.randint(0, 20), r.randint(0, 20)
        kind = r.randrange(4)
        if kind == 0:
            out.append(f"{a} + {b} = {a + b}.")
        elif kind == 1:
            hi, lo = max(a, b), min(a, b)
            out.append(f"{hi} - {lo} = {hi - lo}.")
        elif kind == 2:
            a, b = a % 11, b % 11
            out.append(f"{a} times {b} is {a * b}.")
        else:
            a, b = a % 11, b % 10
            out.append(f"{NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
    return " ".join(out)


def _sequences(r: random.Random) -> str:
    """Ordered lists (days, months, counting): the next item is predictable from the previous one."""
    kind = r.randrange(3)
    if kind == 0:
        start, n = r.randrange(7), r.randint(3, 7)
        days = [DAYS[(start + i) % 7] for i in range(n)]
        return f"The days are {', '.join(days)}. After {days[-1]} comes {DAYS[(start + n) % 7]}."
    if kind == 1:
        start, n = r.randrange(12), r.randint(3, 8)
        months = [MONTHS[(start + i) % 12] for i in range(n)]
        return f"The months are {', '.join(months)}. After {months[-1]} comes {MONTHS[(start + n) % 12]}."
    start = r.randint(0, 10)
    end = r.randint(start + 3, 20)
    words = ", ".join(NUMBER_WORDS[start:end + 1])
    digits = " ".join(str(i) for i in range(start, end + 1))
    return f"Counting from {NUMBER_WORDS[start]} to {NUMBER_WORDS[end]}: {words}. In digits: {digits}."


def _dialogue(r: random.Random) -> str:
    """Two speakers taking turns; questions answered from the fact table."""
    a, b = r.sample(NAMES, 2)
    day, weather = r.choice(DAYS), r.choice(WEATHER)
    out = [f"{a}: Good {r.choice(['morning', 'afternoon', 'evening'])}, {b}!", f"{b}: Hello, {a}. How are you?",
           f"{a}: I am {r.choice(FEELINGS)}, thank you. It is {weather} today."]
    for _ in range(r.randint(1, 3)):
        if r.random() < 0.5:
            animal = r.choice(sorted(ANIMALS))
            food = ANIMALS[animal][1]
            out += [f"{b}: What does {_a(animal)} eat?", f"{a}: {_a(animal).capitalize()} eats {food}."]
        else:
            thing = r.choice(sorted(COLORS))
            out += [f"{b}: What color is the {thing}?", f"{a}: The {thing} is {COLORS[thing]}."]
    out.append(f"{b}: See you on {day}, {a}.")
    return "\n".join(out)


def _shopping(r: random.Random) -> str:
    """Lists and recipes: comma lists and First/Then/Finally step structure."""
    name, dish = r.choice(NAMES), r.choice(DISHES)
    items = r.sample(FOODS, r.randint(3, 6))
    out = [f"{name} went to the market on {r.choice(DAYS)}.",
           f"{name} bought {', '.join(items[:-1])} and {items[-1]}.",
           f"To make {dish}, you need {', '.join(items[:-1])} and {items[-1]}."]
    steps = [s.format(f=r.choice(items), g=r.choice(items), n=r.choice([10, 15, 20, 30, 40]))
             for s in r.sample(STEPS, r.randint(3, 5))]
    out.append(f"First, {steps[0]}.")
    out += [f"Then, {s}." for s in steps[1:-1]]
    out.append(f"Finally, {steps[-1]}.")
    return " ".join(out)


KINDS = [_story, _story, _facts, _arithmetic, _sequences, _dialogue, _shopping]


def make_document(r: random.Random) -> str:
    """One document: 1-4 paragraphs of mixed kinds, so documents vary in length and content."""
    return "\n\n".join(r.choice(KINDS)(r) for _ in range(r.randint(1, 4)))


def make_corpus(target_bytes: int = TARGET_BYTES, seed: int = SEED) -> list[str]:
    r = random.Random(seed)
    docs, size = [], 0
    while size < target_bytes:
        doc = make_document(r)
        docs.append(doc)
        size += len(json.dumps({"text": doc})) + 1
    return docs


PREFERENCE_FILE = "preference.jsonl"
PREFERENCE_PAIRS = 200


def _preference_pair(r: random.Random) -> tuple[str, str, str]:
    """(prompt, chosen, rejected): a question on the fact table, days or sums; chosen is true, rejected false."""
    kind = r.randrange(4)
    if kind == 0:
        animal, other = r.sample(sorted(ANIMALS), 2)
        field, verb = r.choice([(1, "eats"), (0, "has")])
        right, wrong = ANIMALS[animal][field], ANIMALS[other][field]
        if right == wrong:
            wrong = {1: "stones", 0: "ten"}[field]
        tail = " legs" if field == 0 else ""
        question = f"What does {_a(animal)} eat?" if field == 1 else f"How many legs does {_a(animal)} have?"
        subject = _a(animal).capitalize()
        return f"Question: {question}\nAnswer:", f" {subject} {verb} {right}{tail}.", f" {subject} {verb} {wrong}{tail}."
    if kind == 1:
        thing = r.choice(sorted(COLORS))
        wrong = r.choice(sorted(set(COLORS.values()) - {COLORS[thing]}))
        return (f"Question: What color is the {thing}?\nAnswer:", f" The {thing} is {COLORS[thing]}.",
                f" The {thing} is {wrong}.")
    if kind == 2:
        i = r.randrange(7)
        wrong = DAYS[(i + r.randint(2, 6)) % 7]
        return (f"Question: What day comes after {DAYS[i]}?\nAnswer:", f" After {DAYS[i]} comes {DAYS[(i + 1) % 7]}.",
                f" After {DAYS[i]} comes {wrong}.")
    a, b = r.randint(0, 20), r.randint(0, 20)
    wrong = a + b + r.choice([-3, -2, -1, 1, 2, 3])
    return f"Question: What is {a} + {b}?\nAnswer:", f" {a} + {b} = {a + b}.", f" {a} + {b} = {wrong}."


def make_preference(num: int = PREFERENCE_PAIRS, seed: int = SEED) -> list[dict]:
    """The builtin preference set (train.objective dpo/ipo/simpo/orpo with train.dataset builtin): distinct
    prompt/chosen/rejected text records whose chosen answer agrees with the corpus and rejected does not."""
    r, seen, out = random.Random(seed + 1), set(), []
    while len(out) < num:
        prompt, chosen, rejected = _preference_pair(r)
        if (prompt, rejected) not in seen:
            seen.add((prompt, rejected))
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def train_tokenizer(docs: list[str]):
    """Byte-level BPE with exactly VOCAB_SIZE entries: 256 bytes + 1 special + merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def save_tokenizer(tok, out_dir: Path) -> None:
    """Write tokenizer.json plus tokenizer_config.json so AutoTokenizer.from_pretrained(dir) works too."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   bos_token=EOS_TOKEN, unk_token=EOS_TOKEN)
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes "TokenizersBackend"; the older alias loads in both 4.x and 5.x.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> int:
    docs = make_corpus()
    corpus = ASSETS_DIR / CORPUS_FILE
    with corpus.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    with (ASSETS_DIR / PREFERENCE_FILE).open("w", encoding="utf-8") as f:
        for record in make_preference():
            f.write(json.dumps(record) + "\n")
    tok = train_tokenizer(docs)
    save_tokenizer(tok, ASSETS_DIR)
    print(f"{corpus}: {len(docs)} documents, {corpus.stat().st_size} bytes; "
          f"tokenizer vocab {tok.get_vocab_size()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
