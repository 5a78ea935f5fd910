"""Generate fsdp8/assets/corpus.txt: a small, original, English-like training corpus.

The text is drawn from a seeded grammar over a made-up world (animals with fixed habitats
and diets, invented places), plus arithmetic facts in words and digits and short dialogues.
Facts stay consistent across the corpus, so a byte-level model can learn words, templates
and some of the facts within a few hundred small steps. Standard library only; the output
is a pure function of --seed and --bytes.

    python tools/make_corpus.py                  # rewrites fsdp8/assets/corpus.txt
    python tools/make_corpus.py --out /tmp/c.txt --bytes 50000
"""

import argparse
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "fsdp8" / "assets" / "corpus.txt"
DEFAULT_SEED = 8
DEFAULT_BYTES = 300_000

ANIMALS = [
    ("fox", "mammal"), ("otter", "mammal"), ("badger", "mammal"), ("hare", "mammal"),
    ("lynx", "mammal"), ("wolf", "mammal"), ("deer", "mammal"), ("mole", "mammal"),
    ("vole", "mammal"), ("shrew", "mammal"), ("bat", "mammal"), ("seal", "mammal"),
    ("goat", "mammal"), ("yak", "mammal"), ("marten", "mammal"), ("stoat", "mammal"),
    ("heron", "bird"), ("owl", "bird"), ("crane", "bird"), ("finch", "bird"),
    ("sparrow", "bird"), ("raven", "bird"), ("magpie", "bird"), ("swift", "bird"),
    ("trout", "fish"), ("salmon", "fish"), ("eel", "fish"), ("pike", "fish"),
    ("frog", "amphibian"), ("newt", "amphibian"), ("toad", "amphibian"),
    ("lizard", "reptile"), ("tortoise", "reptile"), ("adder", "reptile"),
    ("beetle", "insect"), ("moth", "insect"), ("bee", "insect"), ("ant", "insect"),
    ("snail", "mollusc"), ("crab", "crustacean"),
]
COLOURS = ["red", "blue", "green", "grey", "brown", "black", "white", "golden",
           "silver", "yellow", "orange", "purple", "spotted", "striped"]
TERRAINS = ["hills", "marshes", "forests", "rivers", "lakes", "meadows", "mountains",
            "valleys", "islands", "coasts", "moors", "caves"]
FOODS = ["seeds", "berries", "grass", "leaves", "small fish", "insects", "mice", "worms",
         "roots", "nuts", "fruit", "snails", "moss", "bark", "flowers", "eggs"]
HABITS = ["hunts at night", "sleeps during the day", "swims in cold water",
          "builds its nest in tall reeds", "digs deep burrows", "climbs the old trees",
          "sings at dawn", "travels in large groups", "lives alone", "hides under stones",
          "rests in the winter", "moves slowly", "runs very fast", "calls loudly in spring"]
PLACE_KINDS = ["town", "village", "region", "island", "valley", "port"]
GOODS = ["wool", "cheese", "salt", "copper", "honey", "glass", "rope", "bread", "apples",
         "paper", "boats", "tea"]
SEASONS = ["spring", "summer", "autumn", "winter"]
WEATHER = ["mild", "wet", "cold", "warm", "windy", "dry", "short", "long"]
NAMES = ["Mira", "Tomas", "Ada", "Bram", "Cora", "Dane", "Elin", "Finn", "Greta", "Hugo",
         "Ines", "Jonas", "Kira", "Leo", "Nora", "Otto"]
GREETINGS = ["Good morning.", "Hello.", "Good evening.", "Hello again."]
THANKS = ["Thank you.", "Thanks, that helps.", "I will tell the others.", "Good to know."]

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
        "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """English words for 0 <= n < 1000, e.g. 121 -> 'one hundred and twenty-one'."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    rest = n % 100
    return ONES[n // 100] + " hundred" + (" and " + number_words(rest) if rest else "")


def make_place_name(rng: random.Random) -> str:
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "r", "s", "t", "v", "br", "st", "th", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ae", "ie"]
    codas = ["n", "r", "l", "s", "th", "m", "nd", "lt", "rk", ""]
    syllables = [rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                 for _ in range(rng.choice([2, 2, 3]))]
    return "".join(syllables).capitalize()


def make_world(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Fixed facts: every species and place keeps its attributes for the whole corpus."""
    names: list[str] = []
    while len(names) < 30:
        name = make_place_name(rng)
        if name not in names and len(name) <= 10:
            names.append(name)
    places = [{"name": name, "kind": rng.choice(PLACE_KINDS), "good": rng.choice(GOODS),
               "season": rng.choice(SEASONS), "weather": rng.choice(WEATHER),
               "people": rng.randrange(2, 90) * 100, "near": rng.choice(names)}
              for name in names]
    species = []
    for animal, kind in ANIMALS:
        for colour in rng.sample(COLOURS, 2):
            species.append({"name": f"{colour} {animal}", "kind": kind, "place": rng.choice(places),
                            "terrain": rng.choice(TERRAINS), "foods": rng.sample(FOODS, 2),
                            "habit": rng.choice(HABITS), "size": rng.randrange(2, 150),
                            "years": rng.randrange(1, 30)})
    return species, places


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def plural(noun: str) -> str:
    if noun in ("deer", "salmon", "trout", "pike"):
        return noun
    return noun + ("es" if noun.endswith(("x", "s", "ch", "sh")) else "s")


def years(n: int) -> str:
    return f"{number_words(n)} year{'s' if n != 1 else ''}"


def animal_entry(rng: random.Random, s: dict) -> str:
    name, place = s["name"], s["place"]["name"]
    food_a, food_b = s["foods"]
    sentences = [
        f"The {name} is {article(s['kind'])} {s['kind']} found in the {s['terrain']} of {place}.",
        f"It eats {food_a} and {food_b}, and it {s['habit']}.",
        f"An adult {name} is about {s['size']} centimetres long and lives for {years(s['years'])}.",
    ]
    extra = [
        f"In {s['place']['season']} the {name} is easy to see near {place}.",
        f"People in {place} say that the {name} brings good luck.",
        f"The {name} is not found outside {place}.",
        f"Young {plural(s['name'].split()[-1])} stay with their parents for one {s['place']['season']}.",
    ]
    sentences.append(rng.choice(extra))
    return " ".join(sentences)


def place_entry(rng: random.Random, p: dict) -> str:
    sentences = [
        f"{p['name']} is {article(p['kind'])} {p['kind']} near {p['near']}.",
        f"About {p['people']} people live there, and it is known for its {p['good']}.",
        f"The {p['season']} in {p['name']} is {p['weather']}.",
    ]
    if rng.random() < 0.5:
        sentences.append(f"Traders from {p['near']} come to {p['name']} to buy {p['good']}.")
    return " ".join(sentences)


def arithmetic_fact(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = rng.randrange(0, 60), rng.randrange(0, 40)
        c, sym = a + b, "+"
    elif op == "minus":
        a = rng.randrange(1, 100)
        b = rng.randrange(0, a + 1)
        c, sym = a - b, "-"
    else:
        a, b = rng.randrange(0, 13), rng.randrange(0, 13)
        c, sym = a * b, "*"
    words = f"{number_words(a)} {op} {number_words(b)} is {number_words(c)}."
    digits = f"{a} {sym} {b} = {c}"
    return f"{words.capitalize()}\n{digits}" if rng.random() < 0.5 else f"{digits}\n{words.capitalize()}"


def dialogue(rng: random.Random, species: list[dict], places: list[dict]) -> str:
    a, b = rng.sample(NAMES, 2)
    lines = [f"{a}: {rng.choice(GREETINGS)}", f"{b}: {rng.choice(GREETINGS)}"]
    topic = rng.random()
    if topic < 0.5:
        s = rng.choice(species)
        lines += [f"{a}: Where does the {s['name']} live?",
                  f"{b}: It lives in the {s['terrain']} of {s['place']['name']}.",
                  f"{a}: What does it eat?",
                  f"{b}: It eats {s['foods'][0]} and {s['foods'][1]}."]
    elif topic < 0.75:
        p = rng.choice(places)
        lines += [f"{a}: What is {p['name']} known for?",
                  f"{b}: {p['name']} is known for its {p['good']}.",
                  f"{a}: How many people live there?",
                  f"{b}: About {p['people']} people."]
    else:
        x, y = rng.randrange(1, 20), rng.randrange(1, 20)
        question = f"{number_words(x)} plus {number_words(y)}"
        lines += [f"{a}: What is {question}?",
                  f"{b}: {question.capitalize()} is {number_words(x + y)}."]
    lines.append(f"{a}: {rng.choice(THANKS)}")
    return "\n".join(lines)


def generate(seed: int, target_bytes: int) -> str:
    rng = random.Random(seed)
    species, places = make_world(rng)
    paragraphs: list[str] = []
    size = 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.35:
            text = animal_entry(rng, rng.choice(species))
        elif kind < 0.5:
            text = place_entry(rng, rng.choice(places))
        elif kind < 0.72:
            text = "\n".join(arithmetic_fact(rng) for _ in range(rng.randrange(2, 6)))
        else:
            text = dialogue(rng, species, places)
        paragraphs.append(text)
        size += len(text) + 2
    return "\n\n".join(paragraphs) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="approximate output size")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args()
    text = generate(args.seed, args.bytes)
    args.out.write_bytes(text.encode("ascii"))
    print(f"wrote {len(text)} bytes to {args.out}")


if __name__ == "__main__":
    main()
